"""Continuous batching on the ranks: requests arrive, join the running batch while there is KV
room, and leave as soon as they are done.

Owns the serving call on a rank: which requests each data-parallel replica serves, the clock
the ranks agree on at every step (so every rank of a replica admits the same requests and
all stop together), the per-step records, and our scheduler over transformers' own cache
class (a request's record grows through runtime.inference.serve_records, which both engines share).
Why a scheduler of our own: transformers' engine (ContinuousBatchingManager,
runtime/inference/serve_transformers.py) calls the whole model and pages its own cache, which does not run under pipeline stages, context-parallel attention, FSDP
or sequence parallelism (plan/inference.py says which when). Ours keeps the running
requests in one left-padded `DynamicCache` (runtime.inference.decode runs its forward under any
layout): a step decodes one token for every running request, prefills the requests that
joined and merges their cache rows in; finished rows are dropped and the columns no row
needs any more are cut off. Each request samples with its own seeded generator, so its
tokens do not depend on what it was batched with.

Knows nothing of ipyparallel or the client: records cross the long call's Boundary
(runtime/rank/boundary.py), faults fire there too.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
import torch
import torch.distributed as dist

from ...plan import MeshAxis
from ...records import DecodeStep, Request, RequestRecord, ServeResult, TokenRecord
from ...records.inference import ServeEngine, ServePolicy
from ..layout.parallelized import Parallelized
from ..model.tokenizer import tokenizer_for
from ..parallel.compile import eager_blocks
from ..rank import channel
from ..rank.boundary import Boundary
from .decode import cache_bytes, decoding, forward_last, measured, new_caches
from .generate import encode, pick, suppress_padding
from .serve_records import add_token, close_records, new_record
from .serve_transformers import serve_transformers

IDLE_WAIT_S = 0.01
"""Longest sleep while nothing runs and the next request has not arrived yet."""


@dataclass
class Running:
    """One admitted request: what it has produced and its own sampler."""

    index: int
    req: Request
    record: RequestRecord
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)


@dataclass
class Batch:
    """The running requests and their shared cache, left-padded to one width of columns."""

    rows: list[Running] = field(default_factory=list)
    caches: list | None = None
    mask: torch.Tensor | None = None
    """[b, width]: 1 where a row has a real token (cached), 0 for its left padding."""
    positions: torch.Tensor | None = None
    """[b]: each row's next position."""
    last: torch.Tensor | None = None
    """[b, 1]: each row's latest token, the next step's input."""

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def merge(self, other: "Batch") -> None:
        """Append `other`'s rows, padding the narrower side's cache and mask on the left."""
        if not self.rows:
            self.rows, self.caches, self.mask = other.rows, other.caches, other.mask
            self.positions, self.last = other.positions, other.last
            return
        width = max(self.width, other.width)
        for mine, theirs in zip(self.caches, other.caches):
            for a, b in zip(mine.layers, theirs.layers):
                if getattr(a, "is_initialized", False) and a.keys is not None:
                    a.keys = torch.cat([_pad_left(a.keys, width), _pad_left(b.keys, width)])
                    a.values = torch.cat([_pad_left(a.values, width), _pad_left(b.values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(other.mask, width)])
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])
        self.rows += other.rows

    def keep(self, alive: list[int]) -> None:
        """Only the rows `alive`, then cut the leading columns no row uses any more."""
        self.rows = [self.rows[i] for i in alive]
        if not alive:
            self.caches = self.mask = self.positions = self.last = None
            return
        index = torch.tensor(alive, dtype=torch.long, device=self.mask.device)
        self.mask, self.positions, self.last = self.mask[index], self.positions[index], self.last[index]
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, first:]
        for cache in self.caches:
            for layer in cache.layers:
                if getattr(layer, "is_initialized", False) and layer.keys is not None:
                    layer.keys = layer.keys[index, :, first:]
                    layer.values = layer.values[index, :, first:]


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros on the left of the sequence dim (-2 of a [b, heads, s, d] cache, -1 of a mask)."""
    dim = -1 if t.dim() == 2 else -2
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


class Server:
    """Our scheduler on one rank; every rank of a replica runs the same one in lockstep."""

    def __init__(self, par: Parallelized, requests: list[Request], mine: list[int], *, rank: int, policy: str,
                 max_batch: int, kv_tokens: int | None, leader: bool, boundary: Boundary):
        self.par, self.requests, self.rank, self.boundary = par, requests, rank, boundary
        self.policy, self.max_batch, self.kv_tokens = policy, max_batch, kv_tokens
        self.leader = leader
        self.tok = tokenizer_for(par.spec)
        self.waiting = deque(sorted(mine, key=lambda i: (requests[i].arrival, i)))
        self.batch = Batch()
        self.records: dict[int, RequestRecord] = {}
        self.t0 = time.perf_counter()
        self.window_s = 0.0
        self.kv_budget = (kv_tokens or 0) * kv_bytes_per_token(par)

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> list[RequestRecord]:
        """Serve until every request of every replica is done (or the ranks agree to stop)."""
        step = 0
        while True:
            stop, now, busy = agree(self.par, self.elapsed(), bool(self.waiting or self.batch.rows))
            if stop or not busy:
                break
            joining = self.admit(now)
            if not joining and not self.batch.rows:
                ahead = [self.requests[i].arrival - now for i in self.waiting]
                time.sleep(min(max(min(ahead, default=0.0), 0.0), IDLE_WAIT_S))
                continue
            self.boundary.fire()  # between steps (the ranks agreed on stopping above, with the clock)
            self.step(step, joining, now)
            step += 1
        self.window_s = self.elapsed()
        for i in self.waiting:  # never admitted: the ranks agreed to stop first
            self.records[i] = new_record(self.requests[i], self.rank, "ours")
        close_records(self.records.values())
        return [self.records[i] for i in sorted(self.records)] if self.leader else []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def admit(self, now: float) -> list[int]:
        """Arrived requests that join now: FIFO, while rows stay <= max_batch and the KV
        rectangle the batch will grow to stays within kv_tokens (static: only into an empty batch)."""
        if self.policy == "static" and self.batch.rows:
            return []
        rows = [(len(r.req.prompt) + len(r.tokens), r.req.max_new_tokens - len(r.tokens)) for r in self.batch.rows]
        width = self.batch.width
        chosen: list[int] = []
        for i in list(self.waiting):
            req = self.requests[i]
            if req.arrival > now or len(rows) + 1 > self.max_batch:
                break
            grown = rows + [(len(req.prompt), req.max_new_tokens)]
            final = max(width, max(p for p, _ in grown)) + max(left for _, left in grown)
            if self.kv_tokens is not None and len(grown) * final > self.kv_tokens:
                break
            rows, width = grown, max(width, len(req.prompt))
            chosen.append(i)
            self.waiting.popleft()
        return chosen

    def step(self, step: int, joining: list[int], now: float) -> None:
        produced: list[tuple[Running, int]] = []
        running = len(self.batch.rows)
        with measured(self.par, self.rank, step) as cost:
            if self.batch.rows:
                produced += self.decode()
            if joining:
                produced += self.prefill(joining, now)
        after = self.elapsed()
        done = self.finish(produced, after)
        if done:
            self.batch.keep([j for j, r in enumerate(self.batch.rows) if r.index not in done])
        phase = "mixed" if joining and running else "prefill" if joining else "decode"
        rec = DecodeStep(rank=self.rank, step=step, phase=phase, start=cost.start, time_s=cost.time_s,
                         tokens=len(produced), running=running + len(joining),
                         waiting=sum(self.requests[i].arrival <= now for i in self.waiting),
                         kv_bytes=cache_bytes(self.batch.caches or []), kv_budget=self.kv_budget,
                         comm_s=cost.comm_s, comm_bytes=cost.comm_bytes, comm_ops=cost.comm_ops, engine="ours")
        self.boundary.send(rec)

    def decode(self) -> list[tuple[Running, int]]:
        b = self.batch
        mask = torch.cat([b.mask, torch.ones_like(b.last)], 1)  # [b, width + 1]
        logits = suppress_padding(forward_last(self.par, b.last, mask, b.positions[:, None], b.caches), self.tok)
        nxt = self.choose(b.rows, logits)
        b.mask, b.positions, b.last = mask, b.positions + 1, nxt
        return list(zip(b.rows, nxt[:, 0].tolist()))

    def prefill(self, joining: list[int], now: float) -> list[tuple[Running, int]]:
        ids, mask = encode([self.requests[i].prompt for i in joining], self.par.device, self.tok)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        caches = new_caches(self.par, len(joining), micro=1)
        logits = suppress_padding(forward_last(self.par, ids, mask, positions, caches), self.tok)
        rows = [self.start(i, now) for i in joining]
        nxt = self.choose(rows, logits)
        self.batch.merge(Batch(rows=rows, caches=caches, mask=mask, positions=positions[:, -1] + 1, last=nxt))
        return list(zip(rows, nxt[:, 0].tolist()))

    def start(self, index: int, now: float) -> Running:
        req = self.requests[index]
        rec = self.records[index] = new_record(req, self.rank, "ours")
        rec.admitted = now
        gen = torch.Generator(device=self.par.device).manual_seed(req.seed) if req.do_sample else None
        return Running(index=index, req=req, record=rec, generator=gen)

    def choose(self, rows: list[Running], logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token [b, 1] under its own request's sampling."""
        out = logits.argmax(-1, keepdim=True)
        for j, r in enumerate(rows):
            if r.req.do_sample:
                out[j] = pick(logits[j:j + 1], do_sample=True, temperature=r.req.temperature, top_k=r.req.top_k,
                              generator=r.generator)[0]
        return out

    def finish(self, produced: list[tuple[Running, int]], now: float) -> set[int]:
        """Record each new token; the indices of the requests that finished."""
        done = set()
        for r, token in produced:
            r.tokens.append(token)
            rec, req = r.record, r.req
            if len(r.tokens) == 1:
                rec.first_token = now
            added = add_token(rec, req, r.tokens, self.tok)
            if rec.finish_reason:
                rec.finished = now
                done.add(r.index)
            if self.leader and self.boundary.streaming:
                self.boundary.send(TokenRecord(rank=self.rank, prompt=r.index, position=len(r.tokens) - 1,
                                               text=added, done=bool(rec.finish_reason), time=time.time()), keep=False)
                if rec.finish_reason:
                    self.boundary.send(rec, keep=False)
        return done


def agree(par: Parallelized, elapsed: float, busy: bool) -> tuple[bool, float, bool]:
    """(stop asked anywhere, the latest clock of any rank, anyone still busy): one all_reduce."""
    asked = channel.stop_requested()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return asked, elapsed, busy
    flags = torch.tensor([float(asked), elapsed, float(busy)], dtype=torch.float64, device=par.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    a, now, b = flags.tolist()
    return a > 0, now, b > 0


def kv_bytes_per_token(par: Parallelized) -> int:
    """Bytes one token of one row adds to this rank's cache: its layers, its heads, keys and values."""
    spec, plan = par.spec, par.plan
    layers = sum(len(s.layer_ids) for s in par.stages) if par.stages else spec.num_layers
    return 2 * 4 * spec.head_dim * (spec.num_kv_heads // plan.tp) * layers


def replica_share(par: Parallelized, requests: list[Request]) -> tuple[list[int], bool]:
    """(the request indices this rank's replica serves, whether this rank reports them).

    Replicas are the dp coordinates: ranks along dp share no collective in a forward, so
    each serves its own requests (round-robin in arrival order). Ranks along fsdp, tp, pp
    and cp work on the same requests together; their coordinate-0 rank reports them. Under
    ep an ep group wider than fsdp x cp spans several dp coordinates, whose ranks then meet in
    every forward's all-to-all: those coordinates serve as one replica, in lockstep.
    """
    plan = par.plan
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    joined = max(1, plan.ep // (plan.fsdp * plan.cp))
    dp_coord = par.coords.get(MeshAxis.DP, 0)
    replicas, replica = plan.dp // joined, dp_coord // joined
    mine = [i for k, i in enumerate(order) if k % replicas == replica]
    leader = dp_coord % joined == 0 and all(v == 0 for k, v in par.coords.items()
                                            if str(k) in ("fsdp", "tp", "pp", "cp"))
    return mine, leader


@torch.no_grad()
def serve(par: Parallelized, requests: list[Request], *, engine: ServeEngine, reason: str, policy: ServePolicy,
          max_batch: int, kv_tokens: int | None, rank: int, boundary: Boundary) -> ServeResult:
    """This rank's part of a serving call (see the module docstring); its records cross the
    call's `boundary` (runtime/loop.py), which keeps the steps no driver took."""
    mine, leader = replica_share(par, requests)
    was_training = par.model.training
    par.model.eval()
    try:
        if engine == "transformers":
            with eager_blocks(par.plan):  # process-wide: the engine's thread runs the blocks eagerly too
                records, window = serve_transformers(par, requests, mine, rank=rank, max_batch=max_batch,
                                                     kv_tokens=kv_tokens, leader=leader, boundary=boundary)
        else:
            server = Server(par, requests, mine, rank=rank, policy=policy, max_batch=max_batch, kv_tokens=kv_tokens,
                            leader=leader, boundary=boundary)
            with decoding(par):  # not around transformers' engine: its own thread makes its cache
                records = server.run()
            window = server.window_s
    finally:
        par.model.train(was_training)
    return ServeResult(engine=engine, reason=reason, policy=policy, plan=par.plan.describe(),
                       wall_s=window, requests=records, steps=list(boundary.kept))
