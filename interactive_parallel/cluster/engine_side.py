"""What the client installs inside each ipyparallel engine, and what only the engine knows.

Owns the names a %%px cell finds on every rank, the folders put on the engines' sys.path for
functions shipped from local files, how runtime.rank.channel talks to the client through ipyparallel's own machinery, and the
controller address this engine registered with (the rendezvous is chosen on the interface
that reaches it). Records go out with `publish_data`, each under a fresh sequence-number
key, so the task's `data` on the client accumulates them in order (calls.RankCaller.stream
reads them). Every publish costs CPU in the engine, the controller and the client, CPU a
small machine's ranks share with their steps (bench/bench_session.py), so records close
together travel together: the first after a pause goes at once, the rest at most every
PUBLISH_S, and whatever is held leaves when the call ends (runtime.rank.channel.flush). A stop request comes in as ipyparallel's `abort` of the task that
is running: the engine's control thread (which serves while the task runs) adds its message
id to the kernel's `aborted` set, and the stop source finds it there at the next boundary.
Runs on engines, but for `folder_to_import`, which the client asks before it ships a
function from a local file; otherwise the client imports this module just to name the
functions it ships.
"""
from __future__ import annotations

import itertools
import threading
import time

PUBLISH_S = 0.1  # live views redraw at most this often anyway
HANDOVER_S = 10.0
"""At most this long for the IOPub thread to hand a record over before a fault ends the process."""


def install() -> bool:
    """Point runtime.rank.channel at this engine's kernel (idempotent)."""
    from IPython import get_ipython
    from ipyparallel.datapub import publish_data

    from ..runtime.rank import channel

    kernel = get_ipython().kernel
    seq = itertools.count()
    held: dict = {}
    sent = [0.0]  # when the last publish left
    # publish_data queues the message for ipykernel's IOPub thread, which hands it to zmq
    io = getattr(kernel.iopub_socket, "io_thread", kernel.iopub_socket)

    def flush(handed_over: bool = False) -> None:
        if held:
            publish_data(dict(held))
            held.clear()
            sent[0] = time.monotonic()
        if handed_over and hasattr(io, "schedule"):
            done = threading.Event()
            io.schedule(done.set)  # the thread runs it after the sends queued before it
            done.wait(HANDOVER_S)

    def sink(record) -> None:
        held[f"{next(seq):012d}"] = record
        if time.monotonic() - sent[0] >= PUBLISH_S:
            flush()

    def stop_source() -> bool:
        msg_id = kernel.get_parent("shell")["header"]["msg_id"]
        if msg_id in kernel.aborted:
            # The request was for this running task; left in the set it would also drop a
            # future message that happened to reuse the id (ipyparallel skips aborted ids).
            kernel.aborted.discard(msg_id)
            _STOPPED.add(msg_id)
        return msg_id in _STOPPED

    channel.set_sink(sink, flush)
    channel.set_stop_source(stop_source)
    kernel.control_handlers[WHERE_REQUEST] = _where_handler(kernel)
    return True


WHERE_REQUEST, WHERE_REPLY = "ip_where_request", "ip_where_reply"
"""A question about where this rank is (its stacks, its groups' latest collectives, or its flight
recorder written for torch's analyzer), asked on
ipyparallel's control channel: the kernel's control thread answers it while the main thread
runs a call, also one blocked in a collective. The client sends it (cluster/where.py); no
socket or thread of our own."""


def _where_handler(kernel):
    from ..runtime import api

    def handle(stream, ident, parent) -> None:
        ask = parent["content"]
        try:
            if ask.get("what") == "collectives":
                found = [r.to_dict() for r in api.collectives(int(ask.get("last", 20)))]
            elif ask.get("what") == "dump":
                found = [api.dump_collectives(str(ask["folder"]))]  # the path it wrote
            else:
                found = [r.to_dict() for r in api.stacks(bool(ask.get("all_threads")), cut=_engine_frame)]
            reply = {"status": "ok", "records": found}
        except Exception as exc:  # noqa: BLE001 - answered, never raised in the control thread
            reply = {"status": "error", "evalue": f"{type(exc).__name__}: {exc}"}
        kernel.session.send(stream, WHERE_REPLY, reply, parent, ident)

    return handle


def _engine_frame(frame) -> bool:
    """The engine's frame that runs a call (an apply request or a %px cell): the frames up to it
    are the engine's own loop, not the rank's work."""
    name, path = frame.f_code.co_name, frame.f_code.co_filename
    return ((name == "do_apply" and path.endswith("kernel.py") and "ipyparallel" in path)
            or (name == "run_code" and path.endswith("interactiveshell.py")))


_STOPPED: set[str] = set()


def controller_address() -> str:
    """The controller's address as this engine reached it (from its registration url)."""
    from urllib.parse import urlsplit

    from ipyparallel.engine.app import IPEngine

    if not IPEngine.initialized():
        raise RuntimeError("not an ipyparallel engine: no controller address")
    return urlsplit(IPEngine.instance().registration_url).hostname


IMPORTABLE = {"interactive_parallel", "torch", "transformers"}
"""Top-level packages every engine imports already: functions from them need no sys.path entry."""


def folder_to_import(fn) -> str | None:
    """The folder a function's module must be imported from on the ranks, when they cannot
    import it already: a local script or test file (a notebook's own functions travel by value;
    the standard library and IMPORTABLE are there)."""
    import os
    import sys

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if module is None or module.__name__ == "__main__" or not path:
        return None
    top = module.__name__.split(".")[0]
    if top in sys.stdlib_module_names or top in IMPORTABLE:
        return None
    return os.path.dirname(os.path.abspath(path))


def add_sys_path(*folders: str) -> None:
    import sys

    sys.path.extend(f for f in folders if f not in sys.path)


def define_px_names() -> None:
    """Names a %%px cell finds ready on every rank: torch, dist, rank, world_size, local_rank."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    from interactive_parallel.runtime.rank import state

    st = state.get()
    get_ipython().user_ns.update(torch=torch, dist=dist, rank=st.rank, world_size=st.world_size,
                                 local_rank=st.local_rank)
