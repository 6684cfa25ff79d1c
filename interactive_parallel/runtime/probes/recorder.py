"""Each process group's latest collectives on this rank, from torch's flight recorder.

Owns switching torch's flight recorder on for the groups made from then on
(`TORCH_FR_BUFFER_SIZE`, read by torch when the process's first group is made; gloo's groups
record too on torch 2.13: tests/test_session.py checks the sequence number of a collective a
rank is blocked in) and reading it back as CollectiveRecords: per group its collective
sequence number (every member counts the same collectives, so a rank behind its peers shows a
smaller one), op, sizes, state and the frame outside torch that issued it. Under gloo the
state is 'scheduled' for every entry, finished or not (torch tracks started / completed for
NCCL only): there the sequence numbers tell who is behind, and stacks() who is still waiting.
The recorder is torch's own, in C++; this module reads its pickle dump (`_dump_fr_trace`: the
JSON one leaves out the frames), and writes it for torch's analyzer
(`python -m torch.distributed.flight_recorder.fr_trace`), which compares every rank's dump
(gloo's recorder leaves out send / recv, and its table of groups, filled in here). Its cost per step:
bench/bench_probes.py. Knows nothing of the comm ledger (probes/ledger.py), of the mesh beyond
the group descriptions torch gives DeviceMesh's groups, or of how the records travel.
"""
from __future__ import annotations

import os

from ...records.stacks import RECORDER_ENTRIES, CollectiveRecord
from .stacks import instrumentation

ENV = "TORCH_FR_BUFFER_SIZE"
ENTRIES = RECORDER_ENTRIES
_OURS: list[str | None] = [None]
_SINCE_NS = [0]
"""When this rank's latest process group was made (time.time_ns): the recorder is one per process
and outlives a group, whose successor is named the same and counts from 1 again, so what it
kept of an earlier group is left out."""


def enable(entries: int) -> int:
    """Record the collectives of every process group created from now on (0: off). A value the
    user put in the environment stands. The entries in force."""
    import time

    _SINCE_NS[0] = time.time_ns()
    now = os.environ.get(ENV)
    if now is not None and now != _OURS[0]:
        return int(now or 0)
    os.environ[ENV] = _OURS[0] = str(int(entries))
    return int(entries)


def start_over() -> None:
    """Leave out what the recorder kept before now (a session reset on the same group)."""
    import time

    _SINCE_NS[0] = time.time_ns()


def group_label(name: str, desc: str) -> str:
    """'world' for the default group, a DeviceMesh axis by its name ('mesh_dp' -> 'dp'), else
    torch's description or name."""
    if desc in ("default_pg", "") and name == "0":
        return "world"
    if desc.startswith("mesh_"):
        return desc[len("mesh_"):]
    return desc or name


def _where(frames: list) -> str:
    """The innermost frame that is neither torch's nor the probes' own (their wrappers around
    torch's collectives are instrumentation): the code that issued the collective."""
    for f in frames or []:  # innermost first
        path = f.get("filename", "")
        if f"{os.sep}torch{os.sep}" not in path and not path.startswith("<") and not instrumentation(path):
            return f"{path.rsplit(os.sep, 1)[-1]}:{f.get('line', '')} in {f.get('name', '')}"
    return ""


def read(rank: int, last: int = 20) -> list[CollectiveRecord]:
    """The latest `last` collectives of every group this rank belongs to, oldest first per group
    (from torch's pickle dump: its JSON dump leaves out the frames)."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False))
    return records(dump, rank, last, _SINCE_NS[0], group_ranks())


def group_ranks() -> dict[str, list[int]]:
    """Each live process group's name (what the recorder's entries name it by) -> its global ranks
    (gloo's recorder leaves its own table of groups empty, so torch's registry is read)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return {str(name): list(dist.get_process_group_ranks(pg)) for pg, name in c10d._world.pg_names.items()}


def records(dump: dict, rank: int, last: int, since_ns: int = 0,
            members: dict[str, list[int]] | None = None) -> list[CollectiveRecord]:
    """CollectiveRecords of a flight recorder dump (torch's entries: process_group [name, desc],
    collective_seq_id / p2p_seq_id, profiling_name 'gloo:all_reduce', sizes, dtypes, state,
    frames innermost first, time_created_ns), the latest `last` per group (its collectives and
    its point-to-point ops apart), entries made before `since_ns` left out; `members`: group
    name -> its global ranks."""
    per_group: dict[tuple, list[CollectiveRecord]] = {}
    for e in dump.get("entries", []):
        if int(e.get("time_created_ns", 0) or 0) < since_ns:
            continue  # an earlier group's
        name, desc = (list(e.get("process_group") or ["", ""]) + ["", ""])[:2]
        if members is not None and str(name) not in members:
            continue  # a group destroyed since (an earlier layout's mesh)
        group, p2p = group_label(str(name), str(desc)), bool(e.get("is_p2p"))
        op = str(e.get("profiling_name", "")).split(":", 1)[-1]
        seq = e.get("p2p_seq_id", 0) if p2p else e.get("collective_seq_id", 0)
        dtypes = e.get("input_dtypes") or []
        per_group.setdefault((group, str(name), p2p), []).append(CollectiveRecord(
            rank=rank, group=group, seq=int(seq or 0), op=op, ranks=list((members or {}).get(str(name), [])),
            p2p=p2p, state=str(e.get("state", "")),
            in_sizes=[list(x) for x in e.get("input_sizes") or []],
            out_sizes=[list(x) for x in e.get("output_sizes") or []],
            dtype=str(dtypes[0]) if dtypes else "", where=_where(e.get("frames")),
            time=float(e.get("time_created_ns", 0) or 0) / 1e9))
    out: list[CollectiveRecord] = []
    for key in sorted(per_group):
        out += per_group[key][-last:] if last > 0 else []
    return out


def write_dump(folder: str, rank: int) -> str:
    """This rank's recorder as torch's pickle dump at folder/rank_<rank>, what its analyzer reads
    (`python -m torch.distributed.flight_recorder.fr_trace <folder> -p rank_`): the live groups'
    entries since the latest group (or reset), and the table of groups, which gloo's recorder leaves empty, filled from torch's
    registry (the analyzer pairs each group's entries across its ranks)."""
    import pickle

    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace
    from torch.distributed import distributed_c10d as c10d

    dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False))
    dump["entries"] = [e for e in dump.get("entries", []) if int(e.get("time_created_ns", 0) or 0) >= _SINCE_NS[0]]
    config = {k: v for k, v in (dump.get("pg_config") or {}).items() if k}
    for pg, name in c10d._world.pg_names.items():
        config.setdefault(str(name), {"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""),
                                      "ranks": str(list(dist.get_process_group_ranks(pg)))})
    dump["pg_config"] = config
    # Entries of groups destroyed since (an earlier layout's mesh) have no row in the table: the
    # analyzer cannot pair them across ranks (it fails on them), and they are not the current state.
    dump["entries"] = [e for e in dump["entries"] if str((e.get("process_group") or [""])[0]) in config]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank_{rank}")
    with open(path, "wb") as f:
        pickle.dump(dump, f)
    return path
