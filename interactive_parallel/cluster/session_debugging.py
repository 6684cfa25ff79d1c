"""The Session's debugging surface: questions a researcher hunting a wrong layout asks of the
laid-out model and of what its ranks did.

Owns the public calls made beside `layout()`: the layout lint (`check_layout`), any rank's
tensor (`fetch`), why each collective of a step happened (`explain_comms`, a grouping of the
telemetry the client already holds: no remote call), and where every rank is right now
(`stacks`, `collectives` from torch's flight recorder, and `dump_collectives` for torch's own
analyzer: asked on ipyparallel's control channel, so they answer while a call runs or hangs:
cluster/where.py). A mixin of Session, like
session_planning.py: stateless, it reads the Session's model operations, rank set, telemetry
and world size (annotated here, assigned by Session); each remote call is written once as
`name_async`, its blocking twin made by `blocking_twins`; bad input is refused before any rank
is touched. Knows nothing of torch or of how the ranks answer (the bodies: cluster/fetch.py,
runtime.api, runtime/layout/lint.py), nor of how a cause is read on a rank
(runtime/probes/causes.py) or how the tree is grouped (records/comm_tree.py).
"""
from __future__ import annotations

import os
import warnings

from ..records import RecordList, TensorKind, comm_tree
from ..records.lint import LINT_COLUMNS, merged
from ..runtime import api
from .fetch import FULL_LIMIT_BYTES, Fetched, fetch
from .model_ops import ModelOps
from .rankset import RankSet
from .telemetry import Telemetry
from .twins import blocking_twins
from .where import ANSWER_S, collectives, dump, stacks


@blocking_twins
class SessionDebugging:
    """Layout checks, tensor reads and the causes of a step's collectives, on the Session (see
    the module docstring)."""

    ranks: RankSet
    model: ModelOps
    telemetry: Telemetry
    world_size: int

    # ---- the layout lint (runtime/layout/lint.py) ------------------------------------------------
    async def check_layout_async(self) -> RecordList:
        """What the layout lint finds in the applied layout, before any step: a LintFinding per
        parameter (or module), mesh axis and fault: a gradient nothing reduces over an axis its
        inputs vary on, one reduced twice, a partial sum handed on unsummed, a fused q|k|v split
        without its per-head regrouping, a collective that moves a tensor every step where none is
        needed, a sharded dim the axis does not divide; each with a one-line reason and the fix,
        and the ranks whose layout holds it. Those that make the numbers wrong come first
        (severity 'wrong'; apply warns of them), then those that only cost traffic ('cost').
        A static reading of each rank's placements and TP plan: nothing runs, no collective."""
        self.model.require_layout()
        await self.ranks.require()
        per_rank = await self.ranks.call(api.check_layout, what="check_layout")
        return RecordList(merged(f for findings in per_rank for f in findings), columns=LINT_COLUMNS)

    # ---- fetch: any rank's tensor ---------------------------------------------------------------
    async def fetch_async(self, name: str, rank: int = 0, *, full: bool = False, what: TensorKind = "param",
                          limit_bytes: int = FULL_LIMIT_BYTES) -> Fetched:
        """Parameter `name` (as layout() names it) as rank `rank` holds it: a Fetched whose
        `tensor` is that rank's local block (a CPU copy) and whose `shards[0]` is its ShardRecord
        (placements, mesh coordinates, index ranges of the whole tensor); `stats()` gives norm,
        min, max and mean. full=True: the whole tensor, put together on this client from one
        block of each distinct index range (no collective on the ranks), refused, naming its
        size, when it exceeds `limit_bytes` (default 256 MiB). `what`: 'param', 'grad', or a
        state AdamW keeps ('exp_avg', 'exp_avg_sq', 'step'; from the first optimizer step on).
        A gradient is computed on request as verify() computes one: a forward and backward of
        the current step's batch on the current weights on every rank, no optimizer step (a
        training step frees its gradients). Refused before any rank is touched: an unknown name
        (naming the nearest), a rank outside the session (naming the world size) or not holding
        the parameter (a pipeline stage it does not run: naming the ranks that do), an unknown
        `what`, no layout applied."""
        return await fetch(self.model, self.ranks, name, rank, full, what, limit_bytes)

    # ---- why each collective happened (records/comm_tree.py) --------------------------------------
    def explain_comms(self, steps: int | None = None, rank: int | None = None) -> RecordList:
        """The collectives of the latest step (or the last `steps` steps, summed) as a tree of
        their causes: each module (or wrapper unit), the ops inside it that needed collectives,
        and the collectives each op needed (op, mesh axis, placements before -> after), every
        node with count, bytes and axis, implicit redistributes counted (CommNodes, depth
        first, largest first: records/comm_tree.py). Summed over every rank, or `rank`'s alone.
        A grouping of `comms()`: no remote call, nothing measured again."""
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank {rank!r} is outside this session: ranks are 0..{self.world_size - 1} "
                             f"(world size {self.world_size})")
        return comm_tree(self.telemetry.comms(steps, raw=True), rank=rank)

    # ---- where every rank is now (cluster/where.py) -------------------------------------------------
    async def stacks_async(self, *, all_threads: bool = False, timeout: float = ANSWER_S) -> RecordList:
        """Every rank's Python stack right now: a StackRecord per rank (per thread with
        `all_threads`), frames outermost first, each a FrameRecord (file, line, function, source
        line) flagged `own` (this package's code) and with `module`, the model module whose
        method it runs (`model.layers.3.mlp`); `collective` names the torch.distributed call it
        waits in, `where` the innermost frame of the user's, the model's or the package's code,
        `state` 'idle', 'running', 'in all_reduce', ... Answers also while `train`, `generate`,
        `serve` or `run` is running, and while a rank is blocked in a collective: each rank's
        control thread answers (the thread ipyparallel's abort uses), not the one running the call.
        A rank that is gone or does not answer within `timeout` seconds gets a row whose `error`
        says so. Only the call's frames are shown (the engine's own loop below it is left out):
        an idle rank has none. Nothing runs on the ranks' main threads; no collective."""
        return await stacks(self.ranks, all_threads, _seconds(timeout))

    async def collectives_async(self, last: int = 20, *, timeout: float = ANSWER_S) -> RecordList:
        """Each rank's latest `last` collectives per process group, from torch's flight recorder
        (on for every group the session makes: `Session(flight_recorder=N)` entries per rank):
        CollectiveRecords with the group ('world', 'dp', 'tp', ...), its sequence number (every
        member of a group counts the same collectives: a rank whose latest number is behind its
        peers' has not reached the collective they wait in), op, input and output sizes, state
        ('scheduled', 'started', 'completed': NCCL's; under gloo always 'scheduled') and
        `where`, the frame outside torch that issued it. Asked like `stacks()`, on each rank's control thread, so it answers during a hang;
        a rank that does not answer within `timeout` is warned of and left out."""
        if not (isinstance(last, int) and not isinstance(last, bool) and last > 0):
            raise ValueError(f"last must be a whole number of collectives >= 1, not {last!r}")
        rows, missing = await collectives(self.ranks, last, _seconds(timeout))
        _warn_missing("no collectives from", missing)
        return rows

    async def dump_collectives_async(self, folder: str, *, timeout: float = ANSWER_S) -> list[str]:
        """Each rank's flight recorder written where torch's own analyzer reads it, `folder/rank_<r>`
        (the folder is made; ranks on several hosts need one they share); then
        `python -m torch.distributed.flight_recorder.fr_trace <folder> -p rank_` pairs every rank's
        collectives and reports the first that not every rank of its group joined. Asked like
        `collectives()`, so it works during a hang; a rank that does not answer within `timeout` is
        warned of. The paths written."""
        if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
            raise ValueError(f"folder must be a directory path, not {folder!r}")
        seconds = _seconds(timeout)  # refused before the folder is made
        folder = os.path.abspath(os.fspath(folder))
        os.makedirs(folder, exist_ok=True)
        paths, missing = await dump(self.ranks, folder, seconds)
        _warn_missing("no dump from", missing)
        return paths


def _seconds(timeout: object) -> float:
    """A timeout as seconds, or ValueError before anything is asked of the ranks."""
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return float(timeout)


def _warn_missing(what: str, missing: dict) -> None:
    """A warning naming each rank that did not answer, and why."""
    if missing:
        warnings.warn(f"{what} " + "; ".join(f"rank {r}: {why}" for r, why in missing.items()))

