"""The rank-side entry points: plans, specs and records in, records out.

Owns what the client (or a torchrun script, or a test) can ask a rank to do, each a
module-level function so ipyparallel ships it by reference. Long calls (`train`,
`generate`) hand each record to runtime.channel as it happens and stop when the ranks
agree to; with no channel hooks installed they return their records at the end. Knows
nothing of ipyparallel itself: every function here also runs in a plain process. Imports
torch only inside functions, so the client can import this module (to name the functions)
without loading torch.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from ..plan import ModelSpec, Plan
from ..records import (FaultSpec, Generation, QuantizeRecord, RankInfo, Request, ServeResult, ShardRecord,
                       StepRecord, TokenRecord, VerifyReport)
from . import state as _state


def identify() -> dict[str, Any]:
    """Facts the client needs to assign ranks, before any torch.distributed exists."""
    from . import warm

    warm.wait()  # the first call: later ones find the imports done
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "pid": os.getpid(), "cores": cores,
            "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def setup(rank: int, world_size: int, local_rank: int, local_world_size: int,
          threads: int | None = None) -> dict[str, Any]:
    from . import dist as _dist

    return _dist.set_identity(rank, world_size, local_rank, local_world_size, threads)


def network(interface: str) -> dict[str, Any]:
    """This rank's address on `interface` ("" when it has none) and the interfaces it does have:
    the client checks every rank before any of them waits for a rendezvous."""
    from . import net

    table = net.ipv4_interfaces()
    addrs = table.get(interface) or []
    return {"host": socket.gethostname(), "address": addrs[0] if addrs else "",
            "interfaces": sorted(n for n, a in table.items() if a)}


def master_endpoint(interface: str | None = None, toward: str | None = None) -> tuple[str, int]:
    """Rank 0's rendezvous address and port: on `interface` when named, else on the interface
    this host reaches `toward` (the controller) through, else loopback. The store's socket is
    bound and listening from here on (no other process can take the port before the store
    does); init_process_group hands it to the store."""
    from . import net

    release_endpoint()
    sock = net.listener(net.rendezvous_address(interface, toward))
    _state.get().extra["store_listener"] = sock
    return sock.getsockname()[0], sock.getsockname()[1]


def init_process_group(addr: str, port: int, device: str, timeout_s: float,
                       interface: str | None = None) -> dict[str, Any]:
    """Join the group at addr:port; {rank, backend, device, interface, address} of this rank."""
    from . import dist as _dist

    listen = _state.get().extra.pop("store_listener", None)
    return _dist.init(addr, port, device, timeout_s, interface=interface, listen=listen)


def wall_clock() -> float:
    """This host's time.time(), which every record's times are in (the client corrects them)."""
    import time

    return time.time()


def teardown() -> bool:
    from . import dist as _dist

    release_endpoint()
    _dist.teardown()
    return True


def release_endpoint() -> None:
    """Close the store socket master_endpoint opened, if no store took it."""
    sock = _state.get().extra.pop("store_listener", None)
    if sock is not None:
        sock.close()


def keep_local() -> int | None:
    """Before a fresh process group: keep this rank's own shards of the weights and optimizer
    state (references, no copy, no collective), so the same plan on the same ranks resumes
    them (apply_plan(restore='kept')). The step they belong to (the client keeps them only
    when every rank holds the same step), or None when there is nothing to keep, or nothing
    trustworthy: a rank that skipped a collective (an injected fault) may hold shards its
    peers never agreed on."""
    from . import faults

    st = _state.get()
    st.extra.pop("kept", None)
    if st.parallel is None or faults.tainted():
        return None
    from .recovery import keep

    dequantize()  # the kept shards are the full-precision weights

    st.extra["kept"] = keep(st.parallel, st.optimizer, st.step)
    return st.step


def doctor(engine_id: int) -> RankInfo:
    from .doctor import check

    return check(engine_id)


def load_model(spec: ModelSpec) -> str:
    st = _state.get()
    st.extra.pop("quantized", None)  # the old model's weights go with it
    st.reset_model()
    st.extra.pop("pending_state", None)  # a re-plan's state of the model loaded before, if one failed
    st.spec = spec
    return spec.name


def apply_plan(plan: Plan, scratch: str | None = None, restore: str | None = None) -> dict[str, Any]:
    """Lay the current logical model out under `plan`; weights, optimizer state and step carry over.

    A layout already here is written to `scratch` (a directory every rank can read) with
    torch.distributed.checkpoint and read back under the new plan, DCP resharding it: no
    rank gathers a whole copy. `restore` says where the state comes from when no layout is
    here (after a re-formed process group): 'kept' (keep_local on every rank, same plan),
    'snapshot' (the newest snapshot under `scratch`), or None (the plan's seed).
    Returns {'coords', 'state': 'seed' | 'carried' | 'kept' | 'snapshot', 'step'}.
    """
    from . import dist as _dist
    from .recovery import rebuild

    st = _state.get()
    if st.spec is None:
        raise RuntimeError(f"rank {st.rank}: no model loaded: call load_model first")
    temporary = None
    if st.parallel is not None:
        import torch.distributed as dist

        from .checkpoint import write_parts

        dequantize()  # the new layout starts from the full-precision weights
        if scratch is None:  # a plain torchrun or test group on one host
            scratch = temporary = _shared_temp_dir()
        path = os.path.join(scratch, "replan")
        write_parts(st.parallel, st.optimizer, path, st.step)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every part is in place before any rank reads
        st.extra["pending_state"] = path
        st.parallel = st.model = st.optimizer = None  # free the old layout before building the new one
    device = _dist.torch_device(plan.device, st.local_rank)
    how, step = rebuild(st, plan, device, scratch, restore)
    from . import faults

    faults.layout_built()
    if temporary is not None and st.rank == 0:
        import shutil

        shutil.rmtree(temporary, ignore_errors=True)
    return {"coords": {str(k): v for k, v in st.parallel.coords.items()}, "state": how, "step": step}


def _shared_temp_dir() -> str:
    """A fresh directory rank 0 makes (on tmpfs when there is one) and names to every rank."""
    import tempfile

    import torch.distributed as dist

    box = [None]
    if _state.get().rank == 0:
        box[0] = tempfile.mkdtemp(prefix="ip-replan-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def update_training(plan: Plan) -> None:
    """Change knobs that need no re-layout (batch size, sequence length, lr, accumulation)."""
    from .train import make_scaler

    st = _require_plan()
    old = st.plan
    st.plan = st.parallel.plan = plan
    for group in st.optimizer.param_groups:
        group["lr"] = plan.lr
    if plan.precision != old.precision:
        st.scaler = make_scaler(plan)


def train(steps: int, snapshot_every: int = 0, scratch: str | None = None) -> list[StepRecord]:
    """Run up to `steps` optimizer steps; each StepRecord goes to runtime.channel as its step
    ends. The ranks agree whether to stop at every boundary (one tiny collective, cast once a
    step's gradients are ready and read at the next boundary), so all of them stop at the
    same boundary: a Stop asked before a step's gradients are ready ends the call after that
    step, one asked while it updates after the next. Every `snapshot_every` steps (0: never)
    the state is written under `scratch` (runtime.checkpoint.snapshot, no collective) for
    recovery.
    Returns the records no channel took (all of them when no driver listens)."""
    from . import channel, faults
    from .train import train_step as _step

    st = _require_plan()
    _refuse_quantized(st, "train")
    if snapshot_every and scratch is None:
        raise RuntimeError(f"rank {st.rank}: snapshots need a scratch directory")
    kept = []
    vote: list = []  # the stop vote cast in the step just run, read at the next boundary
    channel.forget_carried()
    with _long_call():
        for _ in range(steps):
            if channel.read_stop_vote(vote.pop()) if vote else channel.agree_stop(st.parallel.device):
                break
            faults.boundary()
            rec = _step(st.parallel, st.optimizer, st.step, scaler=st.scaler, rank=st.rank,
                        after_backward=lambda: vote.append(channel.cast_stop_vote(st.parallel.device)))
            st.step += 1
            if snapshot_every and st.step % snapshot_every == 0:
                from .checkpoint import snapshot

                snapshot(st.parallel, st.optimizer, os.path.join(scratch, "snapshots"), st.step)
            if not channel.emit(rec):
                kept.append(rec)
        if vote:
            channel.read_stop_vote(vote.pop())  # every rank cast it: complete it before returning
    return kept


def take_snapshot(scratch: str) -> dict[str, Any]:
    """Write the state now under `scratch` (no collective); {path, step, seconds, bytes}."""
    import time

    from .checkpoint import snapshot

    st = _require_plan()
    t0 = time.perf_counter()
    path = snapshot(st.parallel, st.optimizer, os.path.join(scratch, "snapshots"), st.step)
    seconds = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return {"path": path, "step": st.step, "seconds": seconds, "bytes": size}


def generate(prompts: list[str], max_new_tokens: int, options: dict[str, Any]) -> Generation:
    """Completions of this rank's share of `prompts` (KV-cached decoding), keyed by prompt index.

    Data-parallel ranks split the prompts round-robin (inference scales out the same way
    training does); every rank runs the same number of rows so sharded forwards stay in step.
    One rank per replica (tp, pp and cp coordinates 0) streams each decoding step's new text
    as TokenRecords; every rank streams its DecodeSteps. After every step the ranks agree
    whether to stop (asked to, or every row everywhere has finished).
    """
    import time

    from . import channel, faults
    from .generate import generate as _generate

    st = _require_plan()
    par = st.parallel
    mine = list(range(par.data_index, len(prompts), par.data_count))
    rows = -(-len(prompts) // par.data_count)
    padded = [prompts[i] for i in mine] + [prompts[0]] * (rows - len(mine))
    leader = all(v == 0 for k, v in par.coords.items() if str(k) in ("tp", "pp", "cp"))
    kept: list = []

    def on_step(position: int, pieces: list[str], done: list[bool], step) -> bool:
        if leader and channel.streaming():
            now = time.time()
            for j, i in enumerate(mine):
                channel.emit(TokenRecord(rank=st.rank, prompt=i, position=position, text=pieces[j], done=done[j],
                                         time=now))
        if not channel.emit(step):
            kept.append(step)
        if channel.agree_stop(par.device, finished=all(done[:len(mine)])):
            return True
        faults.boundary()  # before the next decoding step
        return False

    with _long_call():
        faults.boundary()  # the first decoding step
        texts = _generate(par, padded, max_new_tokens, rank=st.rank, on_step=on_step, **options)
    return Generation(rank=st.rank, texts={i: texts[j] for j, i in enumerate(mine)}, steps=kept)


def serve(requests: list[Request], options: dict[str, Any]) -> ServeResult:
    """This rank's part of a serving call (runtime.serve): its replica's requests, continuously
    batched by the engine the client chose (options: engine, reason, policy, max_batch,
    kv_tokens). Tokens, finished requests and steps stream through runtime.channel as they
    happen; the records no channel took come back in the ServeResult. Armed faults fire at
    the engines' step boundaries (runtime.serve, runtime.serve_transformers)."""
    from .serve import serve as _serve

    st = _require_plan()
    with _long_call():
        return _serve(st.parallel, list(requests), rank=st.rank, **options)


def quantize(scheme: str) -> QuantizeRecord:
    """Quantize this rank's block linears with torchao (runtime.quantize; a collective when the
    probe's forwards are): bytes before and after, decoding speed and greedy agreement measured.
    A model already quantized goes back to full precision first."""
    from .quantize import quantize as _quantize

    st = _require_plan()
    dequantize()
    record, kept = _quantize(st.parallel, scheme, st.rank)
    st.extra["quantized"] = (scheme, kept)
    return record


def dequantize() -> bool:
    """Put back the full-precision weights quantize kept; False when the model was not quantized."""
    from .quantize import restore

    st = _state.get()
    held = st.extra.pop("quantized", None)
    if held is None or st.parallel is None:
        return False
    restore(st.parallel, held[1])
    return True


def _refuse_quantized(st, what: str) -> None:
    if "quantized" in st.extra:
        raise RuntimeError(f"rank {st.rank}: the model is quantized ({st.extra['quantized'][0]}): {what} needs "
                           "full-precision weights; dequantize() first")


def inject(fault: FaultSpec) -> list[FaultSpec]:
    """Arm a fault on this rank for its next long call (runtime/faults.py); the armed list."""
    from . import faults

    faults.arm(fault)
    return faults.armed()


def disarm() -> int:
    """Forget the faults armed on this rank; how many there were."""
    from . import faults

    return faults.disarm()


def layout() -> list[ShardRecord]:
    """Which index ranges of each parameter this rank holds."""
    from .probes import shard_records

    st = _require_plan()
    return shard_records(st.parallel, st.rank)


def set_probes(flag: bool) -> bool:
    """Switch the per-step probes (memory, comm ledger, compute intervals) on or off."""
    from .probes import set_enabled

    return set_enabled(flag)


def set_debug(flag: bool) -> bool:
    """Before a fresh process group: TORCH_DISTRIBUTED_DEBUG=DETAIL (or OFF) for the groups made
    next. The caller keeps the state with keep_local first and re-applies with restore='kept'."""
    import torch.distributed as tdist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if flag else "OFF"
    tdist.set_debug_level_from_env()
    return flag


def host_memory() -> dict[str, Any]:
    """What this rank's machine has free now (no collective, nothing changed): host, bytes of
    available host memory, and free bytes on this rank's GPU under CUDA (else None)."""
    import psutil
    import torch

    st = _state.get()
    gpu = None
    if torch.cuda.is_available() and st.device == "cuda":
        gpu = int(torch.cuda.mem_get_info(st.local_rank)[0])
    return {"rank": st.rank, "host": socket.gethostname(), "available": int(psutil.virtual_memory().available),
            "gpu_free": gpu}


def full_state_dict() -> dict[str, Any]:
    """Full weights as CPU tensors on every rank (a collective under sharded plans): whole copies,
    for tests and small models; re-plans, checkpoints and verify() never use it."""
    return _require_plan().parallel.full_state_dict()


def verify(step: int | None = None, limit_bytes: int | None = None) -> VerifyReport:
    """The applied plan vs a single-process reference on the same weights and batch, built on
    rank 0 only (a collective); the same report on every rank. No optimizer step. When the
    reference would need more than rank 0's machine has (or `limit_bytes`), the report says
    so with the numbers (`note`) instead of trying."""
    from .verify import verify as _verify

    st = _require_plan()
    _refuse_quantized(st, "verify")
    return _verify(st.parallel, st.step if step is None else step, limit_bytes=limit_bytes)


def save_checkpoint(path: str) -> dict[str, Any]:
    """Write weights, optimizer state and step with torch.distributed.checkpoint (a collective):
    {path, tensors, optimizer, step, plan}."""
    from .checkpoint import save

    st = _require_plan()
    return save(st.parallel, st.optimizer, path, st.step)


def checkpoint_problems(path: str) -> list[str]:
    """Why the checkpoint at `path` does not fit the loaded model (empty: it fits). Reads the
    checkpoint's metadata only; nothing on the rank changes."""
    from .checkpoint import problems

    return problems(_require_plan().parallel, path)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint saved under any plan into the current layout (a collective): weights,
    optimizer state (a fresh optimizer when the checkpoint has none) and step.
    {path, tensors, optimizer, step, plan}. A checkpoint of another model is refused
    (CheckpointMismatch naming the parameters) before anything changes."""
    from .checkpoint import CheckpointMismatch, load, problems
    from .train import make_optimizer

    st = _require_plan()
    found = problems(st.parallel, path)
    if found:
        raise CheckpointMismatch(path, found)
    dequantize()  # the checkpoint's weights are full precision; they replace ours
    st.optimizer = make_optimizer(st.parallel)
    info = load(st.parallel, st.optimizer, path, check=False)
    st.step = info["step"]
    return info


@contextlib.contextmanager
def _long_call():
    """Frame a call that streams and can be stopped: faults armed for it fire in it only, and
    whatever the channel's sink still holds leaves before the call returns or raises."""
    from . import channel, faults

    faults.call_started()
    try:
        yield
    finally:
        try:
            channel.flush()
        finally:
            faults.disarm()


def _require_plan():
    st = _state.get()
    if st.parallel is None:
        raise RuntimeError(f"rank {st.rank}: no plan applied: call apply_plan first")
    return st
