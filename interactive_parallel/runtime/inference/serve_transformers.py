"""Serving through transformers' own continuous-batching engine, where it runs under the plan.

Owns driving a `ContinuousBatchingManager` on this rank: the engine's thread schedules,
pages the KV cache and decodes; this rank's main thread adds each request when its arrival
time comes, reads the streamed outputs (a request's new tokens, its admission and finish
times), cancels a request that produced one of its stop strings, and turns what it saw
into RequestRecords. A forward hook on the model (it runs in the engine's thread, once per
engine step) reads the engine's scheduler and cache for the step's DecodeStep: running and
waiting requests, KV bytes used of the paged cache, and the comm ledger's share of the step.
Under TP the engine's own driver (tp rank 0) takes the requests and broadcasts them to its
TP peers (transformers' DistributedHelper); this module only tells it where the mesh and
the TP plan are, as transformers' own TP loading would have left them on the model, and gives
the engine's gloo group a name of its own each time (`_named_apart`).
A fault armed for the call (runtime.rank.faults) fires in the main thread: at its start and
after each engine step the main thread hands on (the engine runs ahead in its own thread).
Knows nothing of when this engine is chosen (plan/inference.py) or of the client.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from ...records import DecodeStep, Request, RequestRecord, TokenRecord
from ..layout.parallelized import Parallelized
from ..model.tokenizer import tokenizer_for
from ..rank import channel
from ..rank.boundary import Boundary
from .decode import measured
from .serve_records import add_token, close_records, new_record

PAGE = 16
"""Tokens per page of the engine's paged cache."""
POLL_S = 0.02


def _configs(par: Parallelized, requests: list[Request], mine: list[int], max_batch: int, kv_tokens: int | None):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    tok = tokenizer_for(par.spec)
    longest = max((len(requests[i].prompt) + requests[i].max_new_tokens for i in mine), default=PAGE)
    blocks = math.ceil(kv_tokens / PAGE) if kv_tokens else max_batch * math.ceil(longest / PAGE)
    from ..rank import state

    cb = ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=max(blocks, 1), max_batch_tokens=max(256, longest),
        max_requests_per_batch=max_batch, allow_block_sharing=False, use_async_batching=False,
        use_cuda_graph=False, auto_switch_to_flash=False, disable_nccl_graph_mixing=False,
        cpu_group_timeout=state.get().timeout_s)
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id,
                           suppress_tokens=list(range(len(tok), par.spec.vocab_size)))
    return gen, cb


class _StepProbe:
    """Forward hooks that turn each engine step into a DecodeStep (run in the engine's thread)."""

    def __init__(self, par: Parallelized, manager, rank: int):
        self.par, self.manager, self.rank = par, manager, rank
        self.out: deque[DecodeStep] = deque()
        self.count = 0
        self._open = None
        self.handles = [par.raw.register_forward_pre_hook(self.before, with_kwargs=True),
                        par.raw.register_forward_hook(self.after, with_kwargs=True)]

    def before(self, _module, _args, kwargs):
        self._open = measured(self.par, self.rank, self.count)
        self._cost = self._open.__enter__()
        self._tokens = len(kwargs.get("logits_indices", kwargs.get("logits_to_keep", [])))

    def after(self, _module, _args, kwargs, _out):
        self._open.__exit__(None, None, None)
        bp = self.manager.batch_processor
        cache, sched = bp.cache, bp.scheduler
        total = cache.num_sectors * cache.bytes_per_sector
        cost = self._cost
        self.out.append(DecodeStep(
            rank=self.rank, step=self.count, phase="mixed", start=cost.start, time_s=cost.time_s,
            tokens=self._tokens, running=len(sched.active_requests), waiting=len(sched.waiting_requests),
            kv_bytes=int(total - cache.compute_free_capacity(relative=False)), kv_budget=int(total),
            comm_s=cost.comm_s, comm_bytes=cost.comm_bytes, comm_ops=cost.comm_ops, engine="transformers"))
        self.count += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _named_apart(par: Parallelized):
    """While transformers starts an engine: its TP peers' gloo group gets a name no earlier engine's
    had. transformers makes that group on every start, and when it is not the whole world (dp x tp)
    torch names it by a hash of its ranks alone, so a second engine's group met the first one's
    rendezvous keys in the store and connected to closed sockets ("Connection refused", notebook
    08's second serve under dp2 x tp2). The suffix is drawn on tp rank 0 and broadcast over the tp
    group, so the group's ranks agree on it, a replacement rank included."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if par.plan.tp == 1:
        yield
        return
    tag = torch.randint(0, 2 ** 62, (1,)) if par.mesh["tp"].get_local_rank() == 0 else torch.zeros(1, dtype=torch.int64)
    tp = par.mesh["tp"].get_group()
    dist.broadcast(tag, group=tp, group_src=0)
    hashed = c10d._hash_ranks_to_str
    c10d._hash_ranks_to_str = lambda ranks: f"{hashed(ranks)}_engine{int(tag)}"
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = hashed


def serve_transformers(par: Parallelized, requests: list[Request], mine: list[int], *, rank: int,
                       max_batch: int, kv_tokens: int | None, leader: bool,
                       boundary: Boundary) -> tuple[list[RequestRecord], float]:
    """This replica's requests through transformers' engine, its records crossing the call's
    `boundary`; (its records if `leader`, seconds from the start until the last request finished)."""
    tok = tokenizer_for(par.spec)
    model = par.raw
    if par.plan.tp > 1:
        model._device_mesh, model._tp_plan = par.mesh, dict(par.spec.family_info.tp_plan)
    gen, cb = _configs(par, requests, mine, max_batch, kv_tokens)
    with _named_apart(par):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    probe = _StepProbe(par, manager, rank)
    records: dict[str, RequestRecord] = {}
    by_id = {requests[i].id: i for i in mine}
    pending = deque(sorted(mine, key=lambda i: (requests[i].arrival, i)))
    open_ids = set(by_id)
    t0 = time.perf_counter()
    boundary.fire()  # before the engine's first step
    manager.start()
    try:
        while open_ids:
            if channel.stop_requested():
                break
            now = time.perf_counter() - t0
            while pending and requests[pending[0]].arrival <= now:
                req = requests[pending.popleft()]
                records[req.id] = new_record(req, rank, "transformers")
                manager.add_request(tok(req.prompt)["input_ids"], request_id=req.id,
                                    max_new_tokens=req.max_new_tokens, streaming=True, record_timestamps=True)
            out = manager.get_result(timeout=POLL_S)
            _drain(probe, boundary, fire=True)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"rank {rank}: transformers' continuous-batching engine stopped: "
                                       f"{manager.background_thread_status.fatal_error}")
                continue
            if out.request_id not in open_ids:
                continue  # a cancelled request's last words
            rec = records.setdefault(out.request_id, new_record(requests[by_id[out.request_id]], rank, "transformers"))
            if _update(rec, out, requests[by_id[out.request_id]], t0, rank, by_id, leader and boundary, tok):
                open_ids.discard(out.request_id)
                if rec.finish_reason == "stop":
                    manager.cancel_request(out.request_id)
        window = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30, hard_stop=bool(open_ids))
        manager.destroy()
        probe.remove()
        _drain(probe, boundary)
    for i in mine:  # never added: the call was stopped first
        records.setdefault(requests[i].id, new_record(requests[i], rank, "transformers"))
    close_records(records.values())
    return ([records[requests[i].id] for i in mine] if leader else []), window


def _drain(probe: _StepProbe, boundary: Boundary, fire: bool = False) -> None:
    """The engine's finished steps cross the boundary (`fire`: the faults of the next step too:
    the engine runs ahead in its own thread, so this is where the main thread sees a step end)."""
    while probe.out:
        boundary.send(probe.out.popleft())
        if fire:
            boundary.fire()


def _update(rec: RequestRecord, out, req: Request, t0: float, rank: int, by_id: dict,
            streams: Boundary | None, tok) -> bool:
    """Fold one streamed output into the request's record; True when the request is finished.
    `streams`: the boundary its tokens cross as they come (None: not this rank's to stream);
    `tok`: the model's tokenizer."""
    tokens = list(out.generated_tokens)
    new = tokens[rec.tokens:]
    if out.lifespan[0] > 0 and rec.admitted < 0:
        rec.admitted = out.lifespan[0] - t0
    if out.timestamps and rec.first_token < 0:
        rec.first_token = out.timestamps[0] - t0
    finished = False
    for _ in new:
        added = add_token(rec, req, tokens[:rec.tokens + 1], tok)
        finished = bool(rec.finish_reason)
        if finished:
            stamp = out.timestamps[rec.tokens - 1] if out.timestamps and len(out.timestamps) >= rec.tokens else \
                time.perf_counter()
            rec.finished = stamp - t0
        if streams and streams.streaming:
            streams.send(TokenRecord(rank=rank, prompt=by_id[req.id], position=rec.tokens - 1, text=added,
                                     done=finished, time=time.time()), keep=False)
            if finished:
                streams.send(rec, keep=False)
        if finished:
            break
    if out.is_finished() and not finished:
        rec.finish_reason = f"error: {out.error}" if out.error else "length"
        rec.finished = (out.lifespan[1] if out.lifespan[1] > 0 else time.perf_counter()) - t0
        finished = True
    return finished
