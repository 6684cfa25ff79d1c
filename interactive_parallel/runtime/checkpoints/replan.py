"""Staging of a re-plan: the layout that is here written in parts, read back into the new one.

Owns apply_plan's body. A layout already on the rank goes back to full precision, writes
its parts under the scratch directory's `replan` folder with no gather and no collective
(runtime.checkpoints.checkpoint.write_parts; a plain torchrun or test group, which has no session
scratch, gets a fresh directory rank 0 makes and names to every rank), and is freed before
the new one is built, so the two never hold memory together. The new layout is built and
filled by runtime.checkpoints.recovery.rebuild: from those parts (DCP resharding them), kept shards,
the newest snapshot or the plan's seed. Knows nothing of the client: the caller names the
scratch directory and where the state comes from when no layout is here.
"""
from __future__ import annotations

from ...plan import Plan
from ...records import LayoutInfo, RestoreSource, ScratchLayout
from ...records.state import scratch_base


def apply(st, plan: Plan, scratch: ScratchLayout | None, restore: RestoreSource | None) -> LayoutInfo:
    """Lay the model in `st` out under `plan`, its state carried, restored or seeded (see
    runtime.api.apply_plan)."""
    from ..groups import dist as _dist
    from ..rank import faults
    from ..rank.heap import release_freed
    from .recovery import check_restore, rebuild

    check_restore(restore)  # before the layout here is written out and freed
    temporary = None
    if st.parallel is not None:
        if scratch is None:
            scratch = temporary = ScratchLayout(shared_temp_dir(st.rank))
        stage(st, scratch)
    device = _dist.torch_device(plan.device, st.gpu)
    how, step = rebuild(st, plan, device, scratch, restore)
    release_freed()  # the previous layout's pages back to the OS, not held beside the new one (rank/heap.py)
    faults.layout_built()
    if temporary is not None and st.rank == 0:
        import shutil

        shutil.rmtree(temporary.root, ignore_errors=True)
    from ..layout.lint import lint

    # The lint reads the placements just built (no collective, about a millisecond for a small
    # model): every apply returns its findings and the client warns of those that make numbers wrong.
    return LayoutInfo(coords={str(k): v for k, v in st.parallel.coords.items()}, state=how, step=step,
                      findings=lint(st.parallel))


def stage(st, scratch: ScratchLayout) -> None:
    """Write the layout in `st` as parts under `scratch.replan` (every rank's part in place
    before any rank reads), name them as the pending state, and free the layout."""
    import torch.distributed as dist

    from ..inference.quantize import dequantize
    from .checkpoint import write_parts

    dequantize(st)  # the new layout starts from the full-precision weights
    write_parts(st.parallel, st.optimizer, scratch.replan, st.step)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # every part is in place before any rank reads
    st.pending_state = scratch.replan
    st.parallel = st.model = st.optimizer = None  # free the old layout before building the new one


def shared_temp_dir(rank: int) -> str:
    """A fresh directory rank 0 makes (on tmpfs when there is one) and names to every rank."""
    import tempfile

    import torch.distributed as dist

    box = [None]
    if rank == 0:
        box[0] = tempfile.mkdtemp(prefix="ip-replan-", dir=scratch_base())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
