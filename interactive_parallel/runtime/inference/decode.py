"""KV-cached forward of a laid-out model: next-token logits of the last position, on every rank.

Owns which module runs a cached forward under each layout, the transformers caches it
fills, and what one step cost (time, KV bytes, the comm ledger's share):
- under loss parallel (tp) the last position's vocabulary-split logits are gathered (`_whole`).
- one rank, dp, tp: the model's own embeddings, blocks and head run as one pipeline stage
  module (runtime.model.stage.StageModule) with a `DynamicCache`: the transformers model's
  forward around them (its mask building, output classes) cost a quarter of a tiny-llama
  decoding step (measured), and the stage builds the same additive mask itself. Under TP
  each rank's attention projects only its own heads, so its cache holds only those heads.
- fsdp and plans whose data-parallel wrapper holds the root (FSDP2's replicate): the
  transformers model itself, so the wrapper's hooks gather what they manage.
- pp: the stage modules, one cache per micro-batch; the micro-batches flow through the
  stages (runtime/parallel/pp.pipeline_forward) and each stage caches its own layers.
- cp: the prompt's forward runs split over the cp ranks and the cache keeps the gathered
  whole sequence (runtime/parallel/cp.prefill); the decoding steps run whole on every cp
  rank (cp.whole_sequence), a token at a time.
Sequence parallelism and the cp split need a sequence length that divides evenly, which a
one-token step cannot be: the step is padded on the right with tokens that the causal mask
hides from the real ones, and their cache entries are cropped afterwards.

Knows nothing of sampling, prompts or requests (runtime.inference.generate and runtime.inference.serve drive
it), nor of how the layout was built.
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...plan import MeshAxis
from ..layout.parallelized import Parallelized

PAD_ID = 0
"""Token id of the right padding (the causal mask hides it from the real tokens)."""


def decoding(par: Parallelized):
    """The grad mode decoding runs in: torch's inference mode where a forward issues no
    collective (one rank, plain data parallel; measured: a tiny-llama decoding step 1.35 ->
    1.17 ms on one rank), no_grad elsewhere: the comm ledger passes over collectives issued in
    inference mode (runtime/probes/comms.py), and FSDP2's unshard refuses
    inference mode (the unsharded parameters it makes are kept for later training). Under
    Plan(compile=True) the blocks run eagerly here (runtime.parallel.compile.eager_blocks: a
    decoding step's cache length changes every step, and compiling it was measured no faster)."""
    from torch.distributed.fsdp import FSDPModule

    from ..parallel.compile import eager_blocks

    plan = par.plan
    silent = plan.tp == plan.pp == plan.cp == 1 and not any(isinstance(m, FSDPModule) for m in par.raw.modules())
    stack = contextlib.ExitStack()
    stack.enter_context(eager_blocks(plan))  # compile=True compiles training's blocks, not decoding's
    stack.enter_context(torch.inference_mode() if silent else torch.no_grad())
    return stack


def new_caches(par: Parallelized, rows: int, micro: int | None = None) -> list:
    """Empty caches for `rows` rows: one per pipeline micro-batch (at most `micro`, at most one
    per row), one without a pipeline."""
    from transformers import DynamicCache

    parts = 1 if not par.stages else max(1, min(rows, micro or par.plan.n_microbatches))
    return [DynamicCache(config=par.raw.config) for _ in range(parts)]


def cache_length(caches: list) -> int:
    """Tokens held per row (every layer of every micro-batch holds the same count)."""
    for cache in caches:
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                return int(layer.keys.shape[-2])
    return 0


def cache_bytes(caches: list) -> int:
    """Bytes of keys and values this rank holds (its heads, its layers)."""
    total = 0
    for cache in caches:
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False) and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
    return total


def _multiple(par: Parallelized, prefill_split: bool) -> int:
    """What the step's length must divide by: 2*cp (and cp*tp under SP) for a split prompt,
    tp under sequence parallelism, else 1."""
    plan = par.plan
    sp = plan.tp if plan.sequence_parallel and plan.tp > 1 else 1
    if prefill_split:
        return math.lcm(2 * plan.cp, plan.cp * sp)
    return sp


@torch.no_grad()
def forward_last(par: Parallelized, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 caches: list) -> torch.Tensor:
    """Float logits [b, vocab] of the last position of `ids` [b, s] after the cached tokens, on
    every rank, appending the step's keys and values to `caches`.

    `mask` [b, past + s]: 1 for real tokens (cached ones included); `positions` [b, s].
    """
    split = par.cp_model is not None and cache_length(caches) == 0
    extra = (-ids.shape[1]) % _multiple(par, split)
    if extra:
        ids, mask, positions = _pad_right(par, ids, mask, positions, extra)
    last = ids.shape[1] - 1 - extra
    if par.stages:
        from ..parallel.pp import pipeline_forward

        logits = pipeline_forward(par.stages, par.plan, par.group(MeshAxis.PP), ids, par.spec.hidden_size,
                                  par.spec.vocab_size, caches=caches, take=last, attention_mask=mask,
                                  position_ids=positions)
    elif split:
        logits = _cp_prefill(par, ids, mask, positions, caches[0], last)
    elif par.cp_model is not None:
        from ..parallel.cp import whole_sequence

        with whole_sequence():
            logits = par.cp_model(ids, attention_mask=mask, position_ids=positions, cache=caches[0])[:, last]
    elif _wrapped_root(par):
        out = par.raw(input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[0], use_cache=True,
                      logits_to_keep=extra + 1)
        logits = out.logits[:, 0]
    else:
        logits = _whole_stage(par)(ids, attention_mask=mask, position_ids=positions, cache=caches[0])[:, last]
    if extra:
        for cache in caches:
            cache.crop(-extra)
    return _whole(logits).float()


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """Under loss parallel the head's logits are split on the vocabulary (a DTensor): only the
    picked position's are gathered, [b, vocab/tp] per rank -> [b, vocab], so sampling and the
    greedy argmax see the whole row, identical on every tp rank. (A max-and-index all-reduce
    would move less for greedy alone; sampling with top-k needs the row.)"""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


_STAGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _wrapped_root(par: Parallelized) -> bool:
    """True when FSDP2 (fully_shard or replicate) manages the model's root: its hooks must run."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(par.raw, FSDPModule)


def _whole_stage(par: Parallelized):
    """The whole model as one StageModule over the transformers model's own modules (kept per model)."""
    from ..model.stage import StageModule

    stage = _STAGES.get(par.raw)
    if stage is None:
        stage = _STAGES[par.raw] = StageModule(par.raw, par.spec, list(range(par.spec.num_layers)), True, True)
    return stage


def _pad_right(par: Parallelized, ids, mask, positions, extra: int):
    """`extra` tokens after the real ones: causally invisible to them, cropped from the cache after."""
    b = ids.shape[0]
    pad = torch.full((b, extra), PAD_ID, dtype=ids.dtype, device=ids.device)
    step = torch.arange(1, extra + 1, device=ids.device)
    top = max(par.spec.max_positions - 1, 0)
    more = (positions[:, -1:] + step).clamp(max=top)  # learned position tables end at max_positions
    return (torch.cat([ids, pad], 1), torch.cat([mask, torch.ones_like(pad, dtype=mask.dtype)], 1),
            torch.cat([positions.expand(b, -1), more], 1))


def _cp_prefill(par: Parallelized, ids, mask, positions, cache, last: int) -> torch.Tensor:
    """The prompt's forward split over the cp ranks; the logits of global position `last`."""
    from ..parallel.cp import prefill, shard_sequence

    cp, r = par.plan.cp, par.coords[MeshAxis.CP]
    local_ids = shard_sequence(ids, cp, r)  # [b, s/cp]: chunks r and 2cp-1-r
    local_pos = shard_sequence(positions.expand(ids.shape[0], -1), cp, r)
    with prefill(cache, mask):
        logits = par.cp_model(local_ids, position_ids=local_pos, cache=cache)  # [b, s/cp, vocab]
    chunk = ids.shape[1] // (2 * cp)
    j = last // chunk  # the chunk holding `last`, and where it sits on its owner
    owner = j if j < cp else 2 * cp - 1 - j
    index = last - j * chunk + (0 if j < cp else chunk)
    group = par.group(MeshAxis.CP)
    row = _whole(logits[:, index]).float().contiguous() if r == owner else \
        torch.empty(ids.shape[0], logits.shape[-1], device=ids.device)
    dist.broadcast(row, group=group, group_src=owner)
    return row


@dataclass
class StepCost:
    """What one decoding step cost on this rank (records.DecodeStep carries it)."""

    start: float = 0.0
    time_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: int = 0
    comm_ops: int = 0


@contextlib.contextmanager
def measured(par: Parallelized, rank: int, step: int):
    """Time a step and, with the probes on, the communication in it (the comm ledger, on the
    step's clock: probes/clock.py): the union of its ops' intervals is the step's
    communication time, the rest is compute."""
    from .. import probes
    from ..probes import clock, comms

    probed = probes.ENABLED[0] and dist.is_initialized() and dist.get_world_size() > 1
    clk = clock.for_device(par.device) if probed else None
    cost = StepCost(start=time.time())
    t0 = time.perf_counter()
    if not probed:
        yield cost
        _wait_for_device(par)
        cost.time_s = time.perf_counter() - t0
        return
    with comms.recording(rank, step, par.plan, clk) as ledger:
        yield cost
        _wait_for_device(par)
    cost.time_s = time.perf_counter() - t0
    spans = sorted((c.start, c.end) for c in ledger.records)
    busy, reach = 0.0, -math.inf
    for a, b in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    cost.comm_s = min(busy, cost.time_s)
    cost.comm_bytes = sum(c.bytes for c in ledger.records)
    cost.comm_ops = len(ledger.records)


def _wait_for_device(par: Parallelized) -> None:
    """On CUDA the host only queues the step's kernels: wait for them, or time_s is their launch.
    For generate and serve the wait is moved, not added: the step's tokens reach the host
    anyway, inside the step (serve's `.tolist()`) or right after it (generate's `int(...)` of
    the live rows). Transformers' engine (serve_transformers times its forward by hooks)
    reads its sampled ids later, after sampling: there the wait comes that much earlier."""
    if par.device.type == "cuda":
        torch.cuda.synchronize(par.device)
