"""The long calls (train, generate, serve) and the frame each runs in.

Owns `long_call`, the frame of a call that streams and can be stopped (faults armed for
it fire in it only; whatever the channel's sink still holds leaves before it returns or
raises), which gives the call its Boundary (runtime.rank.boundary: what a loop does between
two steps, declared below the loops that cross it), and the bodies of train, generate and
serve, which runtime.api calls once it has checked the rank is ready.

The train loop is the hot path (bench/bench_session.py times it against plain DDP): a
boundary adds no collective of its own under DDP (the vote rides in the step's last
gradient bucket, runtime.rank.channel.ddp_vote_hook) and no per-step work beyond a few calls.
Knows nothing of ipyparallel or of the client: what listens is runtime.rank.channel's business.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from ..plan import MeshAxis
from ..records import (DataSource, GenerateOptions, Generation, Request, ScratchLayout, ServeOptions, ServeResult,
                       StepRecord, TokenRecord)
from .groups import dist as _dist
from .rank import channel, faults
from .rank.heap import release_freed
from .rank.boundary import Boundary


@contextlib.contextmanager
def long_call(device: Any = "cpu") -> Iterator[Boundary]:
    """Frame a call that streams and can be stopped, and give it its Boundary: faults armed
    for it fire in it only, a vote a communication hook carried before it is forgotten, an
    NCCL error it raises marks the group failed (runtime.groups.dist.note_failure), and whatever the
    channel's sink still holds leaves before the call returns or raises."""
    faults.call_started()
    channel.forget_carried()
    boundary = Boundary(device)
    try:
        yield boundary
        boundary.close()
    except BaseException as exc:
        _dist.note_failure(exc)
        raise
    finally:
        try:
            channel.flush()
        finally:
            faults.disarm()
            release_freed()  # the call's freed pages back to the OS, not held into the next (rank/heap.py)


def train(st, steps: int, snapshot_every: int = 0, scratch: ScratchLayout | None = None,
          data: DataSource | None = None) -> list[StepRecord]:
    """Up to `steps` optimizer steps of the layout in `st` on `data`'s text (None: the
    synthetic task; see runtime.api.train); the records no channel took."""
    from .training.data import reading
    from .training.train import train_step

    if snapshot_every and scratch is None:
        raise RuntimeError(f"rank {st.rank}: snapshots need a scratch directory")
    par = st.parallel
    with long_call(par.device) as boundary, reading(data):
        for _ in range(steps):
            if boundary.cross():
                break
            rec = train_step(par, st.optimizer, st.step, scaler=st.scaler, rank=st.rank,
                             after_backward=boundary.cast)
            st.step += 1
            if snapshot_every and st.step % snapshot_every == 0:
                from .checkpoints.checkpoint import snapshot

                snapshot(par, st.optimizer, scratch.snapshots, st.step)
            boundary.send(rec)
    return boundary.kept


def generate(st, prompts: list[str], max_new_tokens: int, options: GenerateOptions) -> Generation:
    """This rank's share of `prompts` decoded under the layout in `st` (see runtime.api.generate)."""
    from .inference.generate import generate as _generate

    par = st.parallel
    mine = list(range(par.data_index, len(prompts), par.data_count))
    rows = -(-len(prompts) // par.data_count)
    padded = [prompts[i] for i in mine] + [prompts[0]] * (rows - len(mine))
    leader = all(v == 0 for k, v in par.coords.items() if k in (MeshAxis.TP, MeshAxis.PP, MeshAxis.CP))
    with long_call(par.device) as boundary:
        def on_step(position: int, pieces: list[str], done: list[bool], step) -> bool:
            if leader and boundary.streaming:
                now = time.time()
                for j, i in enumerate(mine):
                    boundary.send(TokenRecord(rank=st.rank, prompt=i, position=position, text=pieces[j],
                                              done=done[j], time=now), keep=False)
            return boundary.cross(step, finished=all(done[:len(mine)]))

        boundary.fire()  # the first decoding step
        texts = _generate(par, padded, max_new_tokens, rank=st.rank, on_step=on_step, do_sample=options.do_sample,
                          temperature=options.temperature, top_k=options.top_k, seed=options.seed)
    return Generation(rank=st.rank, texts={i: texts[j] for j, i in enumerate(mine)}, steps=boundary.kept)


def serve(st, requests: list[Request], options: ServeOptions) -> ServeResult:
    """This rank's part of a serving call under the layout in `st` (see runtime.api.serve)."""
    from .inference.serve import serve as _serve

    with long_call(st.parallel.device) as boundary:
        return _serve(st.parallel, list(requests), rank=st.rank, engine=options.engine, reason=options.reason,
                      policy=options.policy, max_batch=options.max_batch, kv_tokens=options.kv_tokens,
                      boundary=boundary)
