"""This rank's threads' Python stacks, read from another thread: where the rank is right now.

Owns reading them (`sys._current_frames()` and `traceback`'s frame walk, as faulthandler
and py-spy read them, but as records) and marking each frame: the package's own code, and
the model module whose method it runs (the frame's `self`, looked up in the names the comm
causes gave every module, probes/modules.NAMES, or in a mapping the caller passes). Meant to
be called on a thread other than the one running the rank's call: that one may be blocked
in a collective (gloo and NCCL release the GIL while they wait, so this thread runs). Reading
a frame's locals from another thread takes a snapshot of them and changes nothing. Knows
nothing of how the request arrived (cluster/engine_side.py serves it on ipyparallel's control
thread) nor of collectives' sequence (probes/recorder.py).
"""
from __future__ import annotations

import linecache
import os
import sys
import threading
import time
from typing import Callable, Iterable, Mapping

from ...records.stacks import FrameRecord, StackRecord

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROBES = os.path.dirname(os.path.abspath(__file__)) + os.sep


def instrumentation(path: str) -> bool:
    """Whether a frame's file is the probes' own: their wrappers around torch's collectives (the
    ledger's kernels, a patched wait) are on the stack once a step has been measured, but they
    are instrumentation, not where the rank is (also for the flight recorder's frames)."""
    return os.path.abspath(path).startswith(_PROBES)
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_FUNCOL = os.path.join("torch", "distributed", "_functional_collectives.py")
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")
"""nn.Module's own call machinery: its frames hold the module too, but are not the module's code."""
MAX_FRAMES = 80
"""Innermost frames kept per thread (a recursion would otherwise send thousands)."""


def module_names() -> Mapping:
    """Module -> its path in the model, as the comm causes named them (empty before a layout)."""
    from .modules import NAMES

    return NAMES


def _module_of(frame, names: Mapping) -> str:
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self" or not names or code.co_filename.endswith(_MODULE_CALL):
        return ""
    obj = frame.f_locals.get("self")
    try:
        return names.get(obj, "") or ""
    except TypeError:  # not hashable, or not weak-referenceable: not a module
        return ""


def _frames(top, names: Mapping, cut: Callable[[object], bool] | None) -> list[FrameRecord]:
    """Frames outermost first, each marked; the frames up to and including the last one `cut`
    accepts are left out (the engine's own loop around the running call)."""
    chain = []
    frame = top
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    chain.reverse()
    if cut is not None:
        cuts = [i for i, f in enumerate(chain) if cut(f)]
        if cuts:
            chain = chain[cuts[-1] + 1:]
            while chain and chain[0].f_code.co_filename == "<string>":  # the host's exec of the call
                chain = chain[1:]
        else:
            chain = []  # the thread is not running a call: idle in the engine's loop
    out = []
    for f in chain[-MAX_FRAMES:]:
        path = f.f_code.co_filename
        if instrumentation(path):
            continue
        out.append(FrameRecord(file=path, line=f.f_lineno or 0, function=f.f_code.co_name,
                               code=linecache.getline(path, f.f_lineno or 0).strip(),
                               own=os.path.abspath(path).startswith(_PACKAGE + os.sep),
                               module=_module_of(f, names)))
    return out


def collective_of(frames: Iterable[FrameRecord]) -> str:
    """The outermost public torch.distributed collective on the stack (the one waited in): c10d's,
    or a functional collective's (DTensor's)."""
    for f in frames:
        if f.file.endswith((_C10D, _FUNCOL)) and not f.function.startswith("_"):
            return f.function
    return ""


def capture(rank: int, *, all_threads: bool = False, names: Mapping | None = None,
            cut: Callable[[object], bool] | None = None) -> list[StackRecord]:
    """Every thread's stack (all_threads) or the main thread's, this thread's own left out.
    `cut(frame)`: frames up to the last one it accepts belong to the host, not the call."""
    names = module_names() if names is None else names
    me = threading.get_ident()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    now = time.time()
    for ident, top in sys._current_frames().items():
        if ident == me or (not all_threads and ident != main):
            continue
        frames = _frames(top, names, cut if ident == main else None)
        t = threads.get(ident)
        out.append(StackRecord(rank=rank, thread=t.name if t else f"thread-{ident}", main=ident == main,
                               frames=frames, collective=collective_of(frames), time=now))
    out.sort(key=lambda s: (not s.main, s.thread))
    return out
