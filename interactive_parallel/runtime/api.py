"""The rank-side entry points: plans, specs and records in, records out.

Owns what the client (or a torchrun script, or a test) can ask a rank to do, each a
module-level function so ipyparallel ships it by reference, and the checks that the rank
is ready for it; the bodies live beside it (runtime.groups.join: the steps of forming the
process group, named here with the rest; runtime.checkpoints.replan: a re-plan's staging;
runtime.loop: the long calls, `train`, `generate`, `serve`, which hand each record to
runtime.rank.channel as it happens and stop when the ranks agree to; with no channel hooks
installed they return their records at the end). Everything crossing to or from the
client is a record (interactive_parallel.records) or a plain value. Knows nothing of
ipyparallel itself: every function here also runs in a plain process. Imports torch only
inside functions, so the client can import this module (to name the functions) without
loading torch.
"""
from __future__ import annotations

import socket
from typing import Any

from ..plan import ModelSpec, Plan
from ..records import (DataSource, FaultSpec, GenerateOptions, Generation, HostMemory, LayoutInfo, LintFinding,
                       QuantizeRecord, RankInfo, Request, RestoreSource, SaveInfo, ScratchLayout, ServeOptions, ServeResult,
                       ShardRecord, SnapshotInfo, StepRecord, VerifyReport)
from ..records.calibration import CalibrateOptions
from ..records.hardware import CalibrationSample
from .groups.join import (forget, identify, init_process_group, master_endpoint, network,  # noqa: F401 - entry points
                          release_endpoint, set_debug, setup, teardown, wall_clock)
from .rank import state as _state
from .rank.state import Quantized


def keep_local() -> int | None:
    """Before a fresh process group: keep this rank's own shards of the weights and optimizer
    state (references, no copy, no collective), so the same plan on the same ranks resumes
    them (apply_plan(restore=RestoreSource.KEPT)). The step they belong to (the client keeps
    them only when every rank holds the same step), or None when there is nothing to keep, or
    nothing trustworthy: a rank that skipped a collective (an injected fault) may hold shards
    its peers never agreed on."""
    from .checkpoints.recovery import keep_local as _keep_local

    return _keep_local(_state.get())


def doctor(engine_id: int) -> RankInfo:
    from .groups.doctor import check

    return check(engine_id)


def calibrate(options: CalibrateOptions, spec: ModelSpec | None = None) -> list[CalibrationSample]:
    """This rank's timings of matmuls at the options' shapes, elementwise chains, collectives on
    every group size and layout, and compute / communication overlap (runtime.calibration.calibrate; a
    collective: every rank runs it at once). Needs the process group, not a model: the
    options carry the shapes (plan.calibration.calibrate_options derives them from a spec); with
    `spec`, training steps of it cut to one and three layers too (in this process, beside any
    layout: its own small models)."""
    import torch.distributed as tdist

    from .calibration.calibrate import calibrate as _calibrate

    st = _state.get()
    if not tdist.is_initialized():
        raise RuntimeError(f"rank {st.rank}: no process group: calibrate times collectives on it")
    return _calibrate(options, spec)


def checked_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` checked by transformers (its config built, its model's forward run on the meta
    device), with its family facts derived (runtime.model.families) and its tokenizer one the model
    can take (runtime.model.tokenizer.check: loaded, and kept, from a model directory that brings
    one); nothing else on this rank changes."""
    from .model import tokenizer
    from .model.families import with_facts

    return tokenizer.check(with_facts(spec))


def prompt_lengths(prompts: list[str]) -> list[int]:
    """Tokens each prompt encodes to under the loaded model's tokenizer, special tokens included
    as generation adds them; nothing on this rank changes."""
    from .model.tokenizer import tokenizer_for

    tok = tokenizer_for(_state.get().spec)
    return [len(ids) for ids in tok(list(prompts))["input_ids"]]


def load_model(spec: ModelSpec) -> str:
    st = _state.get()
    st.quantized = None  # the old model's weights go with it
    st.reset_model()
    st.pending_state = None  # a re-plan's state of the model loaded before, if one failed
    st.spec = spec
    return spec.name


def apply_plan(plan: Plan, scratch: ScratchLayout | None = None,
               restore: RestoreSource | None = None) -> LayoutInfo:
    """Lay the current logical model out under `plan`; weights, optimizer state and step carry over.

    A layout already here is written to `scratch.replan` (a directory every rank can read)
    with torch.distributed.checkpoint and read back under the new plan, DCP resharding it: no
    rank gathers a whole copy (runtime.checkpoints.replan). `restore` says where the state comes from
    when no layout is here (after a re-formed process group): KEPT (keep_local on every
    rank, same plan), SNAPSHOT (the newest under `scratch.snapshots`), or None (the plan's
    seed). The LayoutInfo says where it came from.
    """
    from .checkpoints import replan

    st = _state.get()
    if st.spec is None:
        raise RuntimeError(f"rank {st.rank}: no model loaded: call load_model first")
    return replan.apply(st, plan, scratch, restore)


def update_training(plan: Plan) -> None:
    """Change knobs that need no re-layout (batch size, sequence length, lr, accumulation)."""
    from .training.train import make_scaler

    st = _require_plan()
    old = st.plan
    st.plan = st.parallel.plan = plan
    for group in st.optimizer.param_groups:
        group["lr"] = plan.lr
    if plan.precision != old.precision:
        st.scaler = make_scaler(plan)


def train(steps: int, snapshot_every: int = 0, scratch: ScratchLayout | None = None,
          data: DataSource | None = None) -> list[StepRecord]:
    """Run up to `steps` optimizer steps on `data`'s text (None: the synthetic task,
    runtime.training.data); each StepRecord goes to runtime.rank.channel as its step ends. The ranks agree
    whether to stop at every boundary (one tiny collective, cast once a step's gradients are
    ready and read at the next boundary), so all of them stop at the
    same boundary: a Stop asked before a step's gradients are ready ends the call after that
    step, one asked while it updates after the next. Every `snapshot_every` steps (0: never)
    the state is written under `scratch.snapshots` (runtime.checkpoints.checkpoint.snapshot, no
    collective) for recovery. The loop is runtime.loop.train.
    Returns the records no channel took (all of them when no driver listens)."""
    from . import loop

    st = _require_plan()
    _refuse_quantized(st, "train")
    return loop.train(st, steps, snapshot_every, scratch, data)


def data_tokens(data: DataSource) -> int:
    """How many tokens `data`'s text is under the loaded model's tokenizer (documents joined
    by its end-of-sequence token), tokenized now and kept for training; no collective."""
    from .model.tokenizer import tokenizer_for
    from .training.data import token_ids

    st = _state.get()
    if st.spec is None:
        raise RuntimeError(f"rank {st.rank}: no model loaded: call load_model first")
    return int(token_ids(data, tokenizer_for(st.spec)).numel())


def take_snapshot(scratch: ScratchLayout) -> SnapshotInfo:
    """Write the state now under `scratch.snapshots` (no collective): what this rank wrote."""
    import time

    from .checkpoints.checkpoint import snapshot, written_bytes

    st = _require_plan()
    t0 = time.perf_counter()
    path = snapshot(st.parallel, st.optimizer, scratch.snapshots, st.step)
    seconds = time.perf_counter() - t0
    return SnapshotInfo(path=path, step=st.step, seconds=seconds, bytes=written_bytes(path))


def generate(prompts: list[str], max_new_tokens: int, options: GenerateOptions = GenerateOptions()) -> Generation:
    """Completions of this rank's share of `prompts` (KV-cached decoding), keyed by prompt index.

    Data-parallel ranks split the prompts round-robin (inference scales out the same way
    training does); every rank runs the same number of rows so sharded forwards stay in step.
    One rank per replica (tp, pp and cp coordinates 0) streams each decoding step's new text
    as TokenRecords; every rank streams its DecodeSteps. After every step the ranks agree
    whether to stop (asked to, or every row everywhere has finished). The loop is
    runtime.loop.generate.
    """
    from . import loop

    return loop.generate(_require_plan(), prompts, max_new_tokens, options)


def serve(requests: list[Request], options: ServeOptions) -> ServeResult:
    """This rank's part of a serving call (runtime.inference.serve): its replica's requests, continuously
    batched by the engine the client chose (`options`). Tokens, finished requests and steps
    stream through runtime.rank.channel as they happen; the records no channel took come back in
    the ServeResult. Armed faults fire at the engines' step boundaries (runtime.inference.serve,
    runtime.inference.serve_transformers)."""
    from . import loop

    return loop.serve(_require_plan(), requests, options)


def quantize(scheme: str) -> QuantizeRecord:
    """Quantize this rank's block linears with torchao (runtime.inference.quantize; a collective when the
    probe's forwards are): bytes before and after, decoding speed and greedy agreement measured.
    A model already quantized goes back to full precision first."""
    from .inference.quantize import quantize as _quantize

    st = _require_plan()
    dequantize()
    record, full = _quantize(st.parallel, scheme, st.rank)
    st.quantized = Quantized(scheme=scheme, full=full)
    return record


def dequantize() -> bool:
    """Put back the full-precision weights quantize kept; False when the model was not quantized."""
    from .inference.quantize import dequantize as _dequantize

    return _dequantize(_state.get())


def _refuse_quantized(st, what: str) -> None:
    if st.quantized is not None:
        raise RuntimeError(f"rank {st.rank}: the model is quantized ({st.quantized.scheme}): {what} needs "
                           "full-precision weights; dequantize() first")


def inject(fault: FaultSpec) -> list[FaultSpec]:
    """Arm a fault on this rank for its next long call (runtime/rank/faults.py); the armed list."""
    from .rank import faults

    faults.arm(fault)
    return faults.armed()


def disarm() -> int:
    """Forget the faults armed on this rank; how many there were."""
    from .rank import faults

    return faults.disarm()


def layout() -> list[ShardRecord]:
    """Which index ranges of each parameter this rank holds."""
    from .probes import shard_records

    st = _require_plan()
    return shard_records(st.parallel, st.rank)


def check_layout() -> list[LintFinding]:
    """What the layout lint (runtime.layout.lint) finds in this rank's layout: a static reading
    of its placements and TP plan, no collective, nothing run."""
    from .layout.lint import lint

    return lint(_require_plan().parallel)


def fetch(name: str, what: str = "param", send: bool = True, data: DataSource | None = None) -> tuple | None:
    """This rank's block of parameter `name`'s weight, gradient or AdamW state (`what`), as a CPU
    copy: (ShardRecord of the block, the block, (dim, permutation) of a weight stored permuted
    or None); None where this rank does not hold the parameter or `send` is False. A gradient
    is one forward and backward of the current step's batch (from `data`'s text, None: the
    synthetic task) on the current weights, no optimizer step: a collective, every rank calls
    it (runtime.training.tensors)."""
    from .training.data import reading
    from .training.tensors import local_piece

    st = _require_plan()
    _refuse_quantized(st, "fetch")
    with reading(data):
        return local_piece(st, name, what, send)


def stacks(all_threads: bool = False, cut: Any = None) -> list:
    """This rank's threads' stacks now, as StackRecords (runtime/probes/stacks.py), frames marked
    with the model module they run in; asked on a thread other than the call's, which may be
    blocked in a collective. `cut(frame)`: the host's own frames end at the last it accepts."""
    from .probes.stacks import capture

    st = _state.get()
    return capture(st.rank, all_threads=all_threads, names=_module_names(st), cut=cut)


def collectives(last: int = 20) -> list:
    """The latest `last` collectives of each of this rank's process groups, from torch's flight
    recorder (CollectiveRecords: runtime/probes/recorder.py); [] before any group or with it off."""
    import torch.distributed as dist

    from .probes import recorder

    return recorder.read(_state.get().rank, last) if dist.is_initialized() else []


def dump_collectives(folder: str) -> str:
    """This rank's flight recorder written as torch's analyzer reads it, at folder/rank_<rank>."""
    from .probes import recorder

    return recorder.write_dump(folder, _state.get().rank)


def _module_names(st) -> Any:
    from .probes.modules import NAMES

    raw = getattr(st.parallel, "raw", None)
    if len(NAMES) or raw is None:  # the comm causes named every module of the layout
        return NAMES
    return {m: (n or type(raw).__name__) for n, m in raw.named_modules()}


def set_probes(flag: bool) -> bool:
    """Switch the per-step probes (memory, comm ledger, compute intervals) on or off."""
    from .probes import set_enabled

    return set_enabled(flag)


def host_memory() -> HostMemory:
    """What this rank's machine has free now (no collective, nothing changed): host, bytes of
    available host memory, and free bytes on this rank's GPU under CUDA (else None)."""
    import psutil
    import torch

    st = _state.get()
    gpu = None
    if torch.cuda.is_available() and st.device == "cuda":
        gpu = int(torch.cuda.mem_get_info(st.gpu)[0])
    return HostMemory(rank=st.rank, host=socket.gethostname(), available=int(psutil.virtual_memory().available),
                      gpu_free=gpu)


def full_state_dict() -> dict[str, Any]:
    """Full weights as CPU tensors on every rank (a collective under sharded plans): whole copies,
    for tests and small models; re-plans, checkpoints and verify() never use it."""
    return _require_plan().parallel.full_state_dict()


def verify(step: int | None = None, limit_bytes: int | None = None, data: DataSource | None = None) -> VerifyReport:
    """The applied plan vs a single-process reference on the same weights and batch (from
    `data`'s text, None: the synthetic task), built on rank 0 only (a collective); the same
    report on every rank. No optimizer step. When the reference would need more than rank 0's
    machine has (or `limit_bytes`), the report says so with the numbers (`note`) instead of trying."""
    from .training.data import reading
    from .training.verify import verify as _verify

    st = _require_plan()
    _refuse_quantized(st, "verify")
    with reading(data):
        return _verify(st.parallel, st.step if step is None else step, limit_bytes=limit_bytes)


def save_checkpoint(path: str) -> SaveInfo:
    """Write weights, optimizer state and step with torch.distributed.checkpoint (a collective):
    what it wrote."""
    from .checkpoints.checkpoint import save

    st = _require_plan()
    return save(st.parallel, st.optimizer, path, st.step)


def save_pretrained(path: str, max_shard_size: int) -> SaveInfo:
    """Write the model as a transformers directory at `path` (runtime.checkpoints.hf_export; a collective):
    config, generation config, safetensors weights in files of at most `max_shard_size` bytes
    and the tokenizer; what it wrote. No rank gathers the model."""
    from .checkpoints.hf_export import save_pretrained as _save_pretrained

    st = _require_plan()
    _refuse_quantized(st, "save_pretrained")
    return _save_pretrained(st.parallel, path, int(max_shard_size), st.step)


def checkpoint_problems(path: str) -> list[str]:
    """Why the checkpoint at `path` does not fit the loaded model (empty: it fits). Reads the
    checkpoint's metadata only; nothing on the rank changes."""
    from .checkpoints.checkpoint import problems

    return problems(_require_plan().parallel, path)


def load_checkpoint(path: str) -> SaveInfo:
    """Load a checkpoint saved under any plan into the current layout (a collective): weights,
    optimizer state (a fresh optimizer when the checkpoint has none) and step; what it read.
    A checkpoint of another model is refused (CheckpointMismatch naming the parameters)
    before anything changes."""
    from .checkpoints.checkpoint import CheckpointMismatch, load, problems
    from .training.train import make_optimizer

    st = _require_plan()
    found = problems(st.parallel, path)
    if found:
        raise CheckpointMismatch(path, found)
    dequantize()  # the checkpoint's weights are full precision; they replace ours
    st.optimizer = make_optimizer(st.parallel)
    info = load(st.parallel, st.optimizer, path, check=False)
    st.step = info.step
    return info


def _require_plan():
    st = _state.get()
    if st.parallel is None:
        raise RuntimeError(f"rank {st.rank}: no plan applied: call apply_plan first")
    return st
