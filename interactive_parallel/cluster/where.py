"""Where every rank is right now, asked while they run: stacks and latest collectives.

Owns asking each rank's engine on ipyparallel's control channel (the channel `abort` and
`shutdown` use: each engine's kernel serves it on its control thread, so a rank whose main
thread is blocked in a collective, or busy with a train, still answers; the handler is
installed by cluster/engine_side.py) and putting the answers together, one row per rank: a
rank that is gone, or does not answer within the timeout, is named in its row's `error`
rather than waited for. Uses ipyparallel's `Client._send` on its control stream (there is
no public call for a message type of our own). Never goes through `require()`: asking must
not wait for, recover or disturb a running call. Knows nothing of torch or of how a rank
reads its stacks (runtime/probes/stacks.py).
"""
from __future__ import annotations

import asyncio
from typing import Any

from ..records import RecordList, from_dict
from ..records.stacks import COLLECTIVE_COLUMNS, STACK_COLUMNS, CollectiveRecord, StackRecord
from .engine_side import WHERE_REQUEST
from .errors import SessionError

ANSWER_S = 2.0
"""How long a rank may take to answer: its control thread only needs the GIL for a moment."""


async def ask(ranks: Any, content: dict, timeout: float) -> dict[int, list | str]:
    """Rank -> the records it answered with (as dicts), or why there are none."""
    caller, pool = ranks.caller, ranks.pool
    if caller is None or pool is None:
        raise SessionError("the session is stopped")
    client = pool.client
    dead = set(ranks.dead_ranks())
    out: dict[int, list | str] = {r: "its process is gone" for r in dead}
    waiting: dict[int, asyncio.Future] = {}
    for rank, eid in enumerate(caller.engine_ids):
        if rank in dead:
            continue
        try:
            ident = client._build_targets(eid)[0][0]
        except Exception:  # noqa: BLE001 - the controller no longer lists the engine
            out[rank] = "its engine is no longer registered"
            continue
        waiting[rank] = asyncio.wrap_future(client._send(client._control_stream, WHERE_REQUEST, content=content,
                                                         ident=ident))
    if waiting:
        await asyncio.wait(waiting.values(), timeout=timeout)
    for rank, fut in waiting.items():
        if not fut.done():
            fut.cancel()
            out[rank] = f"did not answer within {timeout:g} s"
        elif fut.exception() is not None:
            out[rank] = f"{type(fut.exception()).__name__}: {fut.exception()}"
        else:
            reply = fut.result()["content"]
            out[rank] = reply["records"] if reply.get("status") == "ok" else reply.get("evalue", "failed")
    return dict(sorted(out.items()))


async def stacks(ranks: Any, all_threads: bool = False, timeout: float = ANSWER_S) -> RecordList:
    """Every rank's stacks (StackRecords, rank order); a rank without an answer gets one row
    whose `error` says why."""
    rows: list[StackRecord] = []
    for rank, got in (await ask(ranks, {"what": "stacks", "all_threads": bool(all_threads)}, timeout)).items():
        if isinstance(got, str):
            rows.append(StackRecord(rank=rank, error=got))
        else:
            rows += [from_dict(d) for d in got]
    return RecordList(rows, columns=STACK_COLUMNS)


async def collectives(ranks: Any, last: int, timeout: float = ANSWER_S) -> tuple[RecordList, dict[int, str]]:
    """Every rank's latest `last` collectives per group (CollectiveRecords, rank order), and
    rank -> why it gave none."""
    rows: list[CollectiveRecord] = []
    missing: dict[int, str] = {}
    for rank, got in (await ask(ranks, {"what": "collectives", "last": int(last)}, timeout)).items():
        if isinstance(got, str):
            missing[rank] = got
        else:
            rows += [from_dict(d) for d in got]
    return RecordList(rows, columns=COLLECTIVE_COLUMNS), missing


async def dump(ranks: Any, folder: str, timeout: float = ANSWER_S) -> tuple[list[str], dict[int, str]]:
    """Each rank's flight recorder written for torch's analyzer (folder/rank_<r>): the paths
    written, and rank -> why it wrote none."""
    paths: list[str] = []
    missing: dict[int, str] = {}
    for rank, got in (await ask(ranks, {"what": "dump", "folder": folder}, timeout)).items():
        if isinstance(got, str):
            missing[rank] = got
        else:
            paths += [str(p) for p in got]
    return paths, missing
