"""Memory of one rank: bytes of parameters, gradients, optimizer state, and the step's activations.

Owns the counting rules. Every tensor is counted by its *local* part (a DTensor by its
`_local_tensor`) and by unique storage: FSDP2 gradients are views into one reduce-scatter
buffer and its parameters views into padded shards, so per-tensor `nbytes` would be
wrong; a storage's full `nbytes` (padding included) is what the process holds.
- params: storages of the parameters this rank trains (`Parallelized.parameters()`).
  Under PP a rank still keeps the rest of the transformers model it was built from;
  those layers are not trained here and are not counted.
- grads: storages of those parameters' `.grad`, read just before `optimizer.step()`.
- optimizer: storages of every tensor in the optimizer's state, read after the step.
- activations: the peak over the step of live bytes saved for backward, from a
  `saved_tensors_hooks` pair: a saved tensor counts from pack until autograd frees it;
  parameters (and views of them, FSDP's gathered weights included) are not counted.
  The same on every device (storages and their data pointers are device-agnostic).
- device peak (CUDA only, `DevicePeak`): the caching allocator's peak allocated bytes
  during the step minus what was allocated at its start: every kind at once (gradients,
  optimizer state made in the step, FSDP's unsharded parameters, temporaries).
- rss: process resident set size at the end of the step, for orientation.

Does not know: temporaries that are never saved for backward (but for the device peak,
which counts them with everything else), what activation recomputation keeps inside its
layers (CPU: torch's checkpoint holds those through saved-tensor hooks of its own;
tests/test_recompute.py measures them with torch's MemTracker), allocator caching, or
DDP's flat bucket buffers (communication scratch, not gradients).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # torch imports it itself: no cost


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding `t`'s bytes on this rank: a DTensor's local part, the buffer an
    AsyncCollectiveTensor wraps (a functional collective's output not yet waited for, which a
    norm right after a rowwise linear saves for backward: Gemma 3), the first rank's tensor of a
    LocalTensor (one tensor per simulated rank), else `t`."""
    while True:  # a DTensor's local part may itself be an AsyncCollectiveTensor (sequence parallel)
        inner = next((x for x in (getattr(t, "_local_tensor", None), getattr(t, "elem", None))
                      if isinstance(x, torch.Tensor)), None)
        if inner is None:
            per_rank = getattr(t, "_local_tensors", None)  # the one-process mode's LocalTensor (runtime.client.local)
            if not per_rank:
                return t
            inner = per_rank[min(per_rank)]  # its ranks hold tensors of the same shapes: the first's stand for all
        t = inner


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage under `t`: its data pointer, except for the fake tensors of a dry
    run (runtime.client.dryrun), whose pointers are all 0: there the storage object itself, which views
    share as they share data."""
    s = t.untyped_storage()
    return s._cdata if is_fake(t) else s.data_ptr()


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage_id, bytes) of the storage under `t`'s local part; None when it has none
    (meta tensors hold nothing: a pipeline stage runs on them while it infers shapes)."""
    t = local(t)
    if t.is_meta:
        return None
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    return (storage_id(t), nbytes) if nbytes else None


def unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            k = _key(t)
            if k is not None:
                seen.add(k)
    return sum(n for _, n in seen)


def param_bytes(params: list[nn.Parameter]) -> int:
    return unique_bytes(params)


def grad_bytes(params: list[nn.Parameter]) -> int:
    return unique_bytes(p.grad for p in params)


def optimizer_bytes(optimizer) -> int:
    return unique_bytes(v for state in optimizer.state.values() for v in state.values())


_PROC: list = []


def rss() -> int:
    try:
        if not _PROC or _PROC[0].pid != os.getpid():
            import psutil

            _PROC[:] = [psutil.Process(os.getpid())]
        return int(_PROC[0].memory_info().rss)
    except Exception:  # noqa: BLE001 - orientation only
        return 0


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset the kernel's peak resident-set counter (VmHWM) to the current RSS, and return that
    RSS in bytes (Linux). With peak_rss() after it: the peak of what runs in between."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """Peak resident set size (VmHWM) in bytes since the process started or reset_peak_rss()."""
    return _status_bytes("VmHWM")


class _Saved:
    """What autograd holds instead of a saved tensor; its death is when the bytes are freed."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker.release(self.key)


class SavedTensors:
    """Peak live bytes saved for backward while the context is open."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {k for k in (_key(t) for t in exclude) if k is not None}
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0
        self.lock = threading.Lock()
        self._ctx = None

    def release(self, key) -> None:
        with self.lock:
            n = self.refs.get(key, 0) - 1
            if n <= 0:
                self.refs.pop(key, None)
                self.live -= key[1]
            else:
                self.refs[key] = n

    def _count(self, t: torch.Tensor) -> tuple[int, int] | None:
        """Count `t`'s storage as live (once however many hold it); its key, or None when not counted."""
        if isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter):
            return None
        key = _key(t)
        if key is None or key in self.exclude:
            return None
        with self.lock:
            n = self.refs.get(key, 0)
            self.refs[key] = n + 1
            if n == 0:
                self.live += key[1]
                self.peak = max(self.peak, self.live)
        return key

    def _pack(self, t: torch.Tensor):
        key = self._count(t)
        return t if key is None else _Saved(t, key, self)

    def hold(self, t: Any) -> None:
        """Count tensors that activation checkpointing keeps for backward by its own means, until
        their storage is freed (a storage's Python object lives exactly as long as its data)."""
        for x in (t if isinstance(t, (list, tuple)) else (t,)):
            if isinstance(x, torch.Tensor):
                key = self._count(x)
                if key is not None:
                    weakref.finalize(local(x).untyped_storage(), self.release, key)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def __enter__(self) -> "SavedTensors":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        self._checkpointing = _SeeCheckpointing(self)
        self._checkpointing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._checkpointing.__exit__(*exc)
        self._ctx.__exit__(*exc)


class _SeeCheckpointing:
    """While open, what torch.utils.checkpoint keeps for backward counts in `tracker` too.

    Inside a checkpointed region torch's own saved-tensor hooks replace the tracker's: the
    forward keeps nothing there but the region's inputs (which the tracker sees) and, under
    selective recomputation, the outputs its policy saves (kept by a dispatch mode); in
    backward the region's forward runs again and its saved tensors are kept by another hook
    until that region's backward uses them. Both keepers are module globals that torch looks
    up at each use, so for the open step they are replaced by subclasses that also hand what
    they keep to the tracker. Nothing else changes (the subclasses call torch's own code).
    """

    def __init__(self, tracker: SavedTensors):
        self.tracker = tracker
        self.saved: list[tuple[str, Any]] = []

    def __enter__(self) -> "_SeeCheckpointing":
        from torch.utils import checkpoint as ckpt

        tracker = self.tracker

        class Recomputed(ckpt._recomputation_hook):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                keep = self.pack_hook

                def pack(x):
                    tracker.hold(x)
                    return keep(x)

                self.pack_hook = pack

        waits = {getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)}

        class Caching(ckpt._CachingTorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                if func.overloadpacket in waits:  # its output is its input (a fake one would look new)
                    return out
                key = ckpt._sac_storage_key(func, args)
                entries = self.storage.get(key)
                if entries and entries.get(self.func_counter[key] - 1, ckpt._RECOMPUTE) is not ckpt._RECOMPUTE:
                    tracker.hold(out)
                return out

        for name, cls in (("_recomputation_hook", Recomputed), ("_CachingTorchDispatchMode", Caching)):
            self.saved.append((name, getattr(ckpt, name)))
            setattr(ckpt, name, cls)
        return self

    def __exit__(self, *exc) -> None:
        from torch.utils import checkpoint as ckpt

        for name, original in self.saved:
            setattr(ckpt, name, original)
        self.saved.clear()


class DevicePeak:
    """CUDA: the allocator's peak bytes during the step beyond what was live at its start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def __enter__(self) -> "DevicePeak":
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def peak(self) -> int:
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
