"""The Session's debugging surface: looking inside the laid-out model from the notebook.

Owns the public calls a researcher debugging a layout makes beside `layout()`, each a coroutine
`name_async` with its blocking twin made by `blocking_twins`, bad input refused before any rank
is touched. A mixin of Session: it reads the Session's model operations and rank set, annotated
here and assigned by Session. Knows nothing of torch or of how the ranks answer (the bodies:
cluster/fetch.py and runtime.api).
"""
from __future__ import annotations

from ..records import TensorKind
from .fetch import FULL_LIMIT_BYTES, Fetched, fetch
from .model_ops import ModelOps
from .rankset import RankSet
from .twins import blocking_twins


@blocking_twins
class SessionDebugging:
    """Calls that look inside the laid-out model, on the Session (see the module docstring)."""

    ranks: RankSet
    model: ModelOps

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
