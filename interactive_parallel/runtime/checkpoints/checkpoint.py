"""Model and optimizer state through torch.distributed.checkpoint (DCP), under any plan.

Owns the state a rank saves and loads: its own shards of the weights and of AdamW's
moments and step counts (torch's `get_state_dict` / `set_state_dict` helpers, flattened
so a pipeline rank names only its own parameters), and the training step; every entry
under its logical name (a tied LM head under the embedding's name, Parallelized.canonical)
and in its logical layout (a fused q|k|v stored permuted under TP goes to DCP as the
pieces it holds, runtime.layout.pieces), so a state written under one plan loads under any
other, DCP resharding on load. No rank gathers a whole tensor. Hyperparameters are not
saved: they come from the plan that loads the state.

Layout of a state directory (DCP keys): `model.<name>`, `optim.<name>.<exp_avg|exp_avg_sq|
step>` (absent while the optimizer has taken no step: a fresh AdamW stays fresh),
`train.step`. Checkpoints (Session.save) are DCP's standard files, written and read with its
collective planning. Re-plans and snapshots (scratch, runtime.checkpoints.rawfiles) are written in parts
(write_parts): every rank writes its data-parallel replica's share of its shards, and under ep
its own experts, which its replicas do not hold (replicas
hold the same shards: each writes about 1/dp of them) in a directory of its own with DCP's
`no_dist`, under a temporary name moved into place once complete (runtime.checkpoints.atomic_dir), and
rank 0 names the plan and the writers; no collective, so no rank waits on a peer's disk
(bench/bench_state.py times both). Any layout reads the parts back as one checkpoint,
DCP resharding where the layout differs (load_parts). Snapshots (for recovery) are such
directories, one per generation, under one folder; a generation counts once every
writer's part is there, so a rank killed while writing one leaves the previous one to
restore.

Knows nothing of the client or of how the layout was made; the caller says where.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ...plan import MeshAxis, Plan, mesh_rank
from ...records import SaveInfo
from ..layout.parallelized import Parallelized
from ..layout.pieces import Pieces
from . import atomic_dir

SNAPSHOT_PREFIX = "step-"
PLAN_FILE = "plan.json"
"""In a snapshot: the plan whose layout wrote it (a restore under another plan goes through it)."""


class CheckpointMismatch(ValueError):
    """A state directory that does not fit the model: `problems` names each parameter."""

    def __init__(self, path: str, problems: list[str]):
        self.path, self.problems = path, list(problems)
        super().__init__(f"{path} does not hold this model's parameters:\n  - " + "\n  - ".join(self.problems))


# ---- capturing the live state ------------------------------------------------------------------
def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False: under PP the model also holds (meta) layers of other stages.
    return StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def live_state(par: Parallelized, optimizer, with_optim: bool) -> tuple[dict, dict, dict]:
    """(DCP state, model state dict, optimizer state dict): the last two as torch's helpers
    return them (for set_state_dict), the first a flat dict of the same tensors (aliases: DCP
    reads from and loads into the live storage) under logical names and layouts.

    An optimizer without state gets it from the helpers (a zero step at lr 0), so only ask
    for it when it has stepped or when a saved state is about to be loaded into it.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if with_optim:
        model_sd, optim_sd = get_state_dict(par.raw, optimizer, options=_options())
    else:
        model_sd, optim_sd = get_model_state_dict(par.raw, options=_options()), {}
    owned = set(par.owned_keys())
    model_sd = {k: v for k, v in model_sd.items() if k in owned}
    state: dict[str, Any] = {}
    for name, t in model_sd.items():
        state.setdefault(f"model.{par.canonical(name)}", _logical(par, name, t))
    for key, t in optim_sd.items():
        section, _, rest = key.partition(".")
        if section != "state":
            continue  # param_groups: the plan's hyperparameters, not state
        name, _, field = rest.rpartition(".")
        state.setdefault(f"optim.{par.canonical(name)}.{field}", _logical(par, name, t))
    return state, model_sd, optim_sd


def _logical(par: Parallelized, name: str, t: torch.Tensor) -> Any:
    perm = par.perms.get(name)
    if perm is None or not isinstance(t, torch.Tensor) or t.dim() <= perm[0]:
        return t
    return Pieces.of(t, perm)


# ---- DCP with pieces ---------------------------------------------------------------------------
def _planners():
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict.get(index.fqn)
            return obj.view_at(index.offset) if isinstance(obj, Pieces) else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # DCP's set-up replaces values of types it does not know by None, in place.
            held = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
            super().set_up_planner(state_dict, metadata, is_coordinator)
            state_dict.update(held)
            self.state_dict.update(held)

        def lookup_tensor(self, index):
            obj = self.state_dict.get(index.fqn)
            return obj.view_at(index.offset) if isinstance(obj, Pieces) else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def write(state: dict, path: str, raw: bool = False, local: bool = False) -> None:
    """DCP save (a collective); each rank writes one file of its own pieces. `raw`: the
    scratch format (runtime.checkpoints.rawfiles), else DCP's standard files. `local`: this rank alone
    writes all of `path` (DCP's no_dist: no collective), for reading back by the same layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from .rawfiles import RawWriter

    save_planner, _ = _planners()
    os.makedirs(path, exist_ok=True)
    # sync_files=False: the state directories are scratch (tmpfs) or the user's own path,
    # where the OS writes back in its own time; fsync per file costs more than the write.
    writer = (RawWriter if raw else FileSystemWriter)(path, single_file_per_rank=True, sync_files=False,
                                                      thread_count=1)
    # Not DCP's plan caching, though it would make each save cheaper: its cache lives in each
    # process, so a replaced rank (fresh, no cache) breaks the next save.
    dcp.save(state, storage_writer=writer, planner=save_planner(), no_dist=local)


def reader(path: str, raw: bool = False, parts: list[str] | None = None):
    """DCP's storage reader of `path`: its standard files, the scratch format (`raw`), or
    `parts`: these subdirectories of `path`, each written by one rank alone, as one checkpoint
    (runtime.checkpoints.rawfiles.PartsReader, read with no collective)."""
    from torch.distributed.checkpoint import FileSystemReader

    from .rawfiles import PartsReader, RawReader

    return PartsReader(path, parts) if parts is not None else (RawReader if raw else FileSystemReader)(path)


def read(state: dict, storage, local: bool = False) -> None:
    """DCP load from `storage` (a reader()) into the tensors of `state`, in place (a collective;
    `local`: of this rank alone)."""
    import torch.distributed.checkpoint as dcp

    _, load_planner = _planners()
    dcp.load(state, storage_reader=storage, planner=load_planner(), no_dist=local)


def saved_keys(path: str) -> dict[str, tuple[int, ...] | None]:
    """Key -> global shape (None for non-tensor entries) of a state directory, from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata()
    return {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
            for k, v in md.state_dict_metadata.items()}


def problems(par: Parallelized, path: str) -> list[str]:
    """Why the model state at `path` does not fit this model (same answer on every rank)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return [f"{path} is not a torch.distributed.checkpoint directory (no .metadata)"]
    from ...plan.estimate import parameter_mismatches

    saved = {k[len("model."):]: v or () for k, v in saved_keys(path).items() if k.startswith("model.")}
    expected: dict[str, tuple[int, ...]] = {}
    for name, t in par.raw.state_dict().items():  # every stage's names: meta tensors carry shapes
        expected.setdefault(par.canonical(name), tuple(t.shape))
    return parameter_mismatches(expected, saved)


# ---- save / load -------------------------------------------------------------------------------
def save(par: Parallelized, optimizer, path: str, step: int, *, raw: bool = False,
         local: bool = False) -> SaveInfo:
    """Write weights, optimizer state (once it has stepped) and step under `path`; a collective.
    `raw`: in the scratch format (re-plans, snapshots), read back with load(raw=True).
    `local`: this rank's shards alone, no collective (read back with load(local=True))."""
    state, _, _ = live_state(par, optimizer, with_optim=bool(optimizer.state))
    state["train.step"] = int(step)
    write(state, path, raw, local)
    return _info(par, path, state)


def _info(par: Parallelized, path: str, state: dict) -> SaveInfo:
    return SaveInfo(path=path, tensors=sum(k.startswith("model.") for k in state),
                    optimizer=any(k.startswith("optim.") for k in state), step=int(state["train.step"]),
                    plan=par.plan.describe())


def load(par: Parallelized, optimizer, path: str, *, check: bool = True, raw: bool = False,
         local: bool = False, parts: list[str] | None = None) -> SaveInfo:
    """Read `path` into the current layout and optimizer, in place; a collective (not with
    `local` or `parts`, see reader).

    Refuses (CheckpointMismatch, on every rank, before anything changes) a state of another
    model. Without optimizer state in `path` the optimizer is left fresh (the caller makes a
    new one). Returns what it read (SaveInfo).
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if check:
        found = problems(par, path)
        if found:
            raise CheckpointMismatch(path, found)
    storage = reader(path, raw, parts)
    with_optim = any(k.startswith("optim.") for k in storage.read_metadata().state_dict_metadata)
    state, model_sd, optim_sd = live_state(par, optimizer, with_optim=with_optim)
    state["train.step"] = 0
    read(state, storage, local or parts is not None)
    if with_optim:
        set_state_dict(par.raw, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=_options())
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(par.raw, model_sd, options=_options())
    return _info(par, path, state)


# ---- snapshots ---------------------------------------------------------------------------------
def snapshot_dirs(folder: str) -> list[str]:
    """Complete snapshots under `folder`, oldest first: rank 0 has named the plan and its
    writers, and every writer's directory is in place with DCP's metadata in it."""
    if not os.path.isdir(folder):
        return []
    complete = []
    for name in sorted(n for n in os.listdir(folder) if n.startswith(SNAPSHOT_PREFIX)):
        path = os.path.join(folder, name)
        try:
            writers = parts_info(path)["writers"]
        except (OSError, ValueError, KeyError):
            continue
        if all(os.path.isfile(os.path.join(_rank_dir(path, r), ".metadata")) for r in writers):
            complete.append(path)
    return complete


def _rank_dir(path: str, rank: int) -> str:
    return os.path.join(path, f"rank-{rank:05d}")


def written_bytes(path: str) -> int:
    """Bytes this rank wrote into the state directory `path` (write_parts): its own directory
    only, since a peer's may still be moving into place (its files renamed as they are read)."""
    mine = _rank_dir(path, _rank())
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(mine) for f in files)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def write_parts(par: Parallelized, optimizer, path: str, step: int) -> None:
    """This rank's part of a state directory written with no collective: every rank writes its
    replica's share of its shards (DCP's no_dist; data-parallel replicas hold the same shards,
    so each writes about 1/dp of them by bytes, replica_share) under a temporary name and
    moves its directory into place; rank 0 names the plan and the writers, which is how a
    reader knows the directory is complete (snapshot_dirs) and what it holds (load_parts).
    Shared out because one rank writing all of it would hold its peers at their next
    collective for as long as it writes."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, PLAN_FILE + ".tmp"), "w") as f:
            json.dump({"plan": par.plan.to_dict(), "writers": list(range(world))}, f)
        os.replace(os.path.join(path, PLAN_FILE + ".tmp"), os.path.join(path, PLAN_FILE))
    state, _, _ = live_state(par, optimizer, with_optim=bool(optimizer.state))
    state["train.step"] = int(step)
    count, index = _replicas(par)
    own = _own_keys(par, state)
    share = replica_share({k: v for k, v in state.items() if k not in own}, count)[index] + sorted(own)
    mine = _rank_dir(path, rank)
    staging = atomic_dir.staging_path(mine)
    write({k: state[k] for k in share}, staging, raw=True, local=True)
    atomic_dir.publish(staging, mine)


def _own_keys(par: Parallelized, state: dict) -> set[str]:
    """Keys every rank writes itself: under ep the data-parallel replicas hold different experts,
    so an expert weight and its optimizer state are not theirs to share out."""
    if not par.expert_params:
        return set()
    mine = {id(p) for p in par.expert_params}
    names = {n for n, p in par.raw.named_parameters() if id(p) in mine}
    return {k for k in state if (k.startswith("model.") and k[len("model."):] in names)
            or (k.startswith("optim.") and k[len("optim."):].rpartition(".")[0] in names)}


def replica_share(state: dict, count: int) -> list[list[str]]:
    """The keys each of `count` replicas writes: every key once, the largest first to the
    replica with the fewest bytes so far (the same answer on every replica: they hold the
    same keys and shapes); the step in every share, so none is empty."""
    shares: list[list[str]] = [["train.step"] for _ in range(count)]
    loads = [0] * count
    sized = sorted(((_nbytes(v), k) for k, v in state.items() if k != "train.step"), key=lambda x: (-x[0], x[1]))
    for size, key in sized:
        j = loads.index(min(loads))
        shares[j].append(key)
        loads[j] += size
    return shares


def _nbytes(v: Any) -> int:
    """Elements, as a measure of bytes (one state holds one dtype but for the step counts)."""
    return math.prod(v.size()) if isinstance(v, (torch.Tensor, Pieces)) else 0


def _replicas(par: Parallelized) -> tuple[int, int]:
    """(how many data-parallel replicas hold this rank's shards, this rank's index among them);
    (1, 0) for a layout off the plan's mesh (every rank keeps its own)."""
    coords = dict(par.coords)
    if par.plan.dp == 1 or not coords or mesh_rank(coords, par.plan.mesh_shape) != _rank():
        return 1, 0
    return par.plan.dp, coords.get(MeshAxis.DP, 0)


def _replica_ranks(par: Parallelized) -> list[int]:
    """The ranks whose parts together hold this rank's shards: its data-parallel replicas."""
    count, _ = _replicas(par)
    if count == 1:
        return [_rank()]
    coords = dict(par.coords)
    return [mesh_rank({**coords, MeshAxis.DP: j}, par.plan.mesh_shape) for j in range(count)]


def load_parts(par: Parallelized, optimizer, path: str) -> SaveInfo:
    """A directory write_parts wrote (under any plan) into this rank's layout, with no
    collective, DCP resharding where the layout differs (runtime.checkpoints.rawfiles.PartsReader): the
    layout that wrote it reads its replicas' parts, another layout every part."""
    info = parts_info(path)
    ranks = _replica_ranks(par) if Plan.from_dict(info["plan"]).same_layout(par.plan) else info["writers"]
    parts = [os.path.basename(_rank_dir(path, r)) for r in ranks]
    return load(par, optimizer, path, check=False, raw=True, parts=parts)


def snapshot(par: Parallelized, optimizer, folder: str, step: int) -> str:
    """A new generation under `folder` (write_parts: no collective: completion is marked by
    the files themselves, not by barriers that would hold every rank at each snapshot).
    Rank 0 removes the generations before the previous one (every rank has finished that
    one: they have all run the steps in between, with their collectives, since writing it)
    and any of later steps."""
    path = os.path.join(folder, f"{SNAPSHOT_PREFIX}{step:09d}")
    if _rank() == 0:
        os.makedirs(folder, exist_ok=True)
        drop_snapshots_after(folder, step)  # of a run that went back: dead
        earlier = sorted(n for n in os.listdir(folder) if n.startswith(SNAPSHOT_PREFIX) and _snapshot_step(n) < step)
        for old in earlier[:-1]:
            shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    write_parts(par, optimizer, path, step)
    return path


def drop_snapshots_after(folder: str, step: int) -> None:
    """Remove the generations written after `step` (rank 0, when training goes back to it:
    a restored snapshot, a new model): they belong to a run that no longer continues, and
    the same steps will be written again."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name.startswith(SNAPSHOT_PREFIX) and _snapshot_step(name) > step:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _snapshot_step(name: str) -> int:
    digits = name[len(SNAPSHOT_PREFIX):].split(".", 1)[0]
    return int(digits) if digits.isdigit() else 0


def parts_info(path: str) -> dict[str, Any]:
    """What rank 0 wrote of a write_parts directory: {plan (as a dict), writers}."""
    with open(os.path.join(path, PLAN_FILE)) as f:
        return json.load(f)


def snapshot_plan(path: str) -> Plan:
    """The plan whose layout wrote snapshot `path`."""
    return Plan.from_dict(parts_info(path)["plan"])


def latest_snapshot(folder: str) -> str | None:
    found = snapshot_dirs(folder)
    return found[-1] if found else None
