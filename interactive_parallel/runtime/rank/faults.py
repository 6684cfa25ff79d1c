"""Faults on purpose, inside a rank: for the fault tests and for teaching what failures look like.

Owns the faults armed on this rank and where they fire, so a failure is reproducible: at a
step boundary of the next long call (`train`, `generate`, `serve`: the `at_step`-th boundary,
counted from 0 at its start), or inside the n-th collective that step issues. Kinds:
- kill: the process ends at once (SIGKILL), as an out-of-memory kill would end it;
- hang: the rank stops answering (sleeps) while its peers wait in the next collective;
- raise: an InjectedFault exception, as a bug in user code would raise;
- skip_collective: the rank skips one collective its peers issue (they wait for it);
- slow: the rank sleeps `seconds` and goes on (an imbalanced or throttled rank).
A fault fires once and is then disarmed. Just before it acts, the rank sends the fault (its
`time` set) through runtime.rank.channel, so the client can name it even when the rank dies.
Collectives are seen through the comm probe's dispatcher kernels (runtime/probes/comms.py),
which call `on_collective` before each op. A rank that skipped a collective is `tainted`:
its shards may hold what its peers never agreed on, so it does not keep them for recovery.
Knows nothing of who arms faults (the Session's `inject`) or of how errors travel.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
import typing

from ...records import FaultKind, FaultPlace, FaultSpec

KINDS = typing.get_args(FaultKind)
PLACES = typing.get_args(FaultPlace)
HANG_S = 24 * 3600.0
"""A hang lasts until the rank is killed (the Session replaces a rank still stuck after a timeout)."""
FLUSH_S = 0.5
"""Before a kill, once the record is handed to the transport: time for zmq's I/O thread to write it
(it runs when the loaded machine schedules it; 50 ms lost the record once in a full suite run)."""


class InjectedFault(RuntimeError):
    """The exception a 'raise' fault throws (named so that tests and users can tell it apart)."""


_ARMED: list[FaultSpec] = []
_STATE = {"step": -1, "collective": 0, "tainted": False}


def arm(fault: FaultSpec) -> None:
    if fault.fault not in KINDS:
        raise ValueError(f"fault {fault.fault!r} is not one of {', '.join(KINDS)}")
    if fault.where not in PLACES:
        raise ValueError(f"where {fault.where!r} is not one of {', '.join(PLACES)}")
    _ARMED.append(fault)
    if fault.where == "collective" or fault.fault == "skip_collective":
        from ..probes import comms

        comms.set_before(on_collective)  # the dispatcher kernels that see every collective


def disarm() -> int:
    n = len(_ARMED)
    _ARMED.clear()
    return n


def armed() -> list[FaultSpec]:
    return list(_ARMED)


def tainted() -> bool:
    """This rank skipped a collective since its layout was built: its state is not to be kept."""
    return bool(_STATE["tainted"])


def layout_built() -> None:
    """A fresh layout (seed, carried state, snapshot): whatever a skipped collective spoiled is gone."""
    _STATE["tainted"] = False


def call_started() -> None:
    """A long call begins: its boundaries count from 0."""
    _STATE["step"] = -1


def boundary() -> None:
    """Between steps (after the ranks agreed to go on): fire what is armed for the step that starts."""
    _STATE["step"] += 1
    _STATE["collective"] = 0
    for f in _due("step"):
        if f.fault == "skip_collective":
            _promote(f)  # skipping needs a collective: the step's first one
        else:
            _fire(f)


def on_collective(op: str) -> bool:
    """Before each collective of a step: True means skip it (the caller returns as if done)."""
    if not _ARMED:
        return False
    index = _STATE["collective"]
    _STATE["collective"] += 1
    for f in _due("collective"):
        if f.collective == index:
            if f.fault == "skip_collective":
                _ARMED.remove(f)
                _STATE["tainted"] = True
                _announce(f, f" in {op} (collective {index})")
                return True
            _fire(f, f" in {op} (collective {index})")
    return False


def _due(where: str) -> list[FaultSpec]:
    return [f for f in _ARMED if f.where == where and f.at_step == _STATE["step"]]


def _promote(f: FaultSpec) -> None:
    _ARMED.remove(f)
    arm(dataclasses.replace(f, where="collective", collective=0))


def _announce(f: FaultSpec, where: str) -> None:
    """Tell the driver which fault fires, and when, before it acts. Before a fault that may
    end the process (a kill; a skipped collective, after which gloo may abort on the next
    mismatched one), wait until the record has left this process's queues, then give the
    transport's own thread a moment (a loaded machine delays the first; a fixed sleep lost it)."""
    from . import channel

    if channel.emit(dataclasses.replace(f, time=time.time(), detail=f"at step {f.at_step}{where}")):
        ending = f.fault in ("kill", "skip_collective")
        channel.flush(handed_over=ending)  # with the records before it: a hang or a kill would keep them back
        if ending:
            time.sleep(FLUSH_S)


def _fire(f: FaultSpec, where: str = "") -> None:
    _ARMED.remove(f)
    what = f"injected {f.fault} at step {f.at_step}{where}"
    _announce(f, where)
    if f.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.fault == "hang":
        time.sleep(f.seconds if f.seconds > 0 else HANG_S)
    elif f.fault == "raise":
        raise InjectedFault(what)
    elif f.fault == "slow":
        time.sleep(f.seconds)
