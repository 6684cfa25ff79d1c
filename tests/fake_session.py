"""A stand-in for Session that the widget tests drive without processes.

Every public name it defines is one Session defines, with the same parameters and return
annotation (tests/test_widgets.py compares them with `inspect.signature`), and every value it
returns is of the type Session returns: built from the real record classes, kept in the real
telemetry store (cluster/telemetry.py), predictions from the real plan/estimate. What the ranks
would compute is made up: losses fall, one all_reduce per step, a mixture-of-experts model's
routing leans on one expert per layer, completions are the prompt reversed, a calibration returns
the shipped cpu profile renamed; step predictions and plan searches are the real plan/steptime and
plan/search. Each call is appended to `calls`, so tests see what the panel asked for.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
import traceback
from dataclasses import replace
from typing import Any, Callable, Literal, Sequence

from interactive_parallel.cluster.errors import RankError, SessionError
from interactive_parallel.cluster.fetch import FULL_LIMIT_BYTES, Fetched
from interactive_parallel.cluster.telemetry import STEP_COLUMNS, Telemetry
from interactive_parallel.plan import (MeshAxis, ModelSpec, Plan, PlanError, check, expert_coords, expert_groups,
                                       mesh_coords, resolve_model)
from interactive_parallel.plan.estimate import predict_memory
from interactive_parallel.plan.hardware import PROFILES
from interactive_parallel.plan.inference import quantization_problems, request_problems, serving_engine
from interactive_parallel.plan.search import search_plans
from interactive_parallel.plan.steptime import predict_step
from interactive_parallel.plan.virtual import DryRun, Simulated
from interactive_parallel.cluster.where import ANSWER_S
from interactive_parallel.records.stacks import COLLECTIVE_COLUMNS, STACK_COLUMNS, CollectiveRecord, FrameRecord, StackRecord
from interactive_parallel.records import (CommRecord, DecodeStep, ExpertRecord, HardwareProfile, MemoryRecord,
                                          ParamDiff, PipelineEvent, QuantizeRecord, RankInfo, RankPlace, RecordList,
                                          Request, RequestRecord, ServeEngine, ServePolicy, ServeResult, ShardRecord,
                                          StepPrediction, StepRecord, TensorKind, TokenRecord, VerifyReport)
from interactive_parallel.viz.plans import step_times

WORLD = 4
PARAMS = (("lm_head.weight", [128, 64]), ("model.embed_tokens.weight", [128, 64]))

ELEMENTS: dict[str, tuple[type, ...]] = {
    "train_async": (StepRecord,), "generate_async": (str,), "doctor": (RankInfo,), "memory": (MemoryRecord,),
    "comms": (CommRecord,), "timeline": (CommRecord, PipelineEvent), "layout": (ShardRecord,),
    "predict_memory": (MemoryRecord,), "quantize": (QuantizeRecord,), "decoding": (DecodeStep,),
    "quantized": (QuantizeRecord,), "search_plans": (StepPrediction,), "stacks_async": (StackRecord,),
    "collectives_async": (CollectiveRecord,),
}
"""The record types each list-returning method holds: checked on this fake and on a live Session."""


class FakeSession:
    """Session's public surface as the panel uses it (see the module docstring)."""

    def __init__(self, *, world: int = WORLD, fail_step: int | None = None, step_delay: float = 0.0,
                 token_delay: float = 0.0, verify_ok: bool = True):
        self.calls: list[tuple] = []
        self._world, self._fail_step, self._step_delay = world, fail_step, step_delay
        self._token_delay, self._verify_ok = token_delay, verify_ok
        self._telemetry = Telemetry()
        self._spec: ModelSpec | None = None
        self._plan: Plan | None = None
        self._alive = True
        self._stop = threading.Event()
        self._calibrated: HardwareProfile | None = None
        self._training = False

    alive = property(lambda self: self._alive)
    device = property(lambda self: "cpu")
    world_size = property(lambda self: self._world)
    spec = property(lambda self: self._spec)
    plan = property(lambda self: self._plan)
    history = property(lambda self: self._telemetry.history)
    calibrated = property(lambda self: self._calibrated)
    ranks_info = property(lambda self: [RankPlace(rank=r, engine_id=r, host="hostA", pid=1000 + r, cores=2, cuda=0,
                                                  local_rank=r) for r in range(self._world)])

    # ---- the model -----------------------------------------------------------------------------------
    def check_plan(self, plan: Plan) -> Plan:
        if plan.device != "cpu":
            raise PlanError([f"plan device {plan.device!r} != session device 'cpu'"])
        return check(plan, self._world, self._spec)

    def load_model(self, model: Any = "tiny-llama") -> ModelSpec:
        self.calls.append(("load_model", model))
        self._spec = resolve_model(model)
        return self._spec

    def apply(self, plan: Plan, *, keep_quantization: bool = False) -> Plan:
        self.calls.append(("apply", plan))
        self.check_plan(plan)
        self._require_model()
        self._plan = plan
        if not keep_quantization:
            self._telemetry.keep_quantization([])
        return plan

    async def train_async(self, steps: int = 1, *, batch_size: int | None = None, seq_len: int | None = None,
                          grad_accum: int | None = None, lr: float | None = None, precision: str | None = None,
                          max_grad_norm: float | None = None, on_step: Callable[[list[StepRecord]], None] | None = None,
                          snapshot_every: int | None = None, data: str | None = None) -> RecordList:
        self._data = data if data is not None else getattr(self, "_data", None)  # kept, as Session keeps it
        knobs = dict(batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, lr=lr, precision=precision,
                     max_grad_norm=max_grad_norm)
        self.calls.append(("train", steps, knobs))  # snapshots have nothing to keep here
        self._require_model()
        self._stop.clear()
        base = self._plan or Plan(dp=self._world)
        self._plan = self.check_plan(base.replace(**{k: v for k, v in knobs.items() if v is not None}))
        out = RecordList(columns=STEP_COLUMNS)
        first = len({r.step for r in self.history})
        self._training = True
        try:
            await self._train_steps(steps, first, out, on_step)
        finally:
            self._training = False
        return out

    async def _train_steps(self, steps: int, first: int, out: RecordList, on_step) -> None:
        for i in range(steps):
            if self._stop.is_set():
                break
            await asyncio.sleep(self._step_delay)
            if self._fail_step == i:
                raise RankError(1, "RuntimeError", "step exploded", "Traceback (most recent call last):\n  boom",
                                host="hostA", what="train")
            batch = [self._step_record(r, first + i) for r in range(self._world)]
            self._telemetry.add_step(batch)
            out.extend(batch)
            if on_step is not None:
                on_step(batch)

    def _step_record(self, rank: int, step: int) -> StepRecord:
        t = time.time()
        group = list(range(self._world))
        pp = self._plan.pp if self._plan else 1
        events = [PipelineEvent(rank=rank, step=step, stage=rank % pp, microbatch=m, action=a, start=t + 0.01 * k,
                                end=t + 0.01 * k + 0.008)
                  for k, (m, a) in enumerate([(0, "F"), (1, "F"), (0, "B"), (1, "B")])] if pp > 1 else []
        clipped = self._plan.max_grad_norm > 0 if self._plan else False  # the same norm on every rank, as live
        return StepRecord(rank=rank, step=step, loss=5.0 - 0.1 * step + 0.01 * rank, tokens=128, time_s=0.01,
                          plan=self._plan.describe(), grad_norm=3.0 / (1 + step) if clipped else None,
                          memory=MemoryRecord(rank=rank, step=step, params=460_000, grads=460_000, optimizer=920_000,
                                              activations=10_000 + step),
                          comms=[CommRecord(rank=rank, step=step, op="all_reduce", bytes=460_000, dtype="float32",
                                            axis="dp", group=group, start=t, end=t + 0.002, module="ddp bucket 0",
                                            needed_by="bucket all-reduce", phase="backward")],
                          events=events, experts=self._expert_records(rank, step))

    def _routed(self, step: int, layer: int) -> list[int]:
        """Made-up routing of any rank's 128 tokens: even, but for one hot expert taking from its neighbour."""
        n, k = self._spec.num_experts, self._spec.experts_per_token or 1
        routed = [128 * k // n] * n
        hot, cold = (step + layer) % n, (step + layer + 1) % n
        routed[hot], routed[cold] = routed[hot] + routed[cold] // 2, routed[cold] - routed[cold] // 2
        return routed

    def _expert_records(self, rank: int, step: int) -> list[ExpertRecord]:
        n = self._spec.num_experts if self._spec is not None else 0
        if not n or self._plan is None:
            return []
        ep, shape, layers = self._plan.ep, self._plan.mesh_shape, self._spec.num_layers
        coords = mesh_coords(rank, shape)
        group = next(g for g in expert_groups(shape, ep)[0] if rank in g) if ep > 1 else [rank]
        held = {q: list(range(expert_coords(q, shape, ep)[1] * n // ep, (expert_coords(q, shape, ep)[1] + 1) * n // ep))
                for q in group}
        out = []
        for layer in (i for i in range(layers) if i * self._plan.pp // layers == coords[MeshAxis.PP]):
            routed = self._routed(step, layer)
            moved = [sum(routed[e] for e in held[q]) for q in group] if ep > 1 else []
            mine = [sum(routed[e] for e in held[rank])] * len(group) if ep > 1 else []
            out.append(ExpertRecord(rank=rank, step=step, layer=layer, experts=held[rank],
                                    tokens=[routed[e] * len(group) for e in held[rank]], routed=routed,
                                    sent=moved, received=mine, ep_group=group, tp_rank=coords[MeshAxis.TP]))
        return out

    def interrupt(self) -> None:
        self.calls.append(("interrupt",))
        self._stop.set()

    async def generate_async(self, prompts: str | Sequence[str], max_new_tokens: int = 16, *,
                             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                             on_token: Callable[[TokenRecord], None] | None = None) -> list[str]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.calls.append(("generate", prompts, max_new_tokens,
                           dict(do_sample=do_sample, temperature=temperature, top_k=top_k)))
        self._require_model()
        if not prompts:
            raise ValueError("no prompts given")
        self._stop.clear()
        texts = [""] * len(prompts)
        for position in range(max_new_tokens):
            if self._stop.is_set():
                break
            await asyncio.sleep(self._token_delay)
            for i, p in enumerate(prompts):
                piece = p[::-1][position % len(p)]
                texts[i] += piece
                if on_token is not None:
                    on_token(TokenRecord(rank=0, prompt=i, position=position, text=piece,
                                         done=position == max_new_tokens - 1, time=time.time()))
        return texts

    async def serve_async(self, requests: Any, *, engine: ServeEngine | Literal["auto"] = "auto",
                          policy: ServePolicy = "continuous",
                          max_batch: int = 8, kv_tokens: int | None = None,
                          on_token: Callable[[TokenRecord], None] | None = None,
                          on_request: Callable[[RequestRecord], None] | None = None,
                          on_step: Callable[[DecodeStep], None] | None = None) -> ServeResult:
        """Every request admitted on arrival; one token per running request per step (the prompt reversed)."""
        reqs = [r if isinstance(r, Request) else Request(id=str(i), prompt=r) for i, r in enumerate(requests)]
        self.calls.append(("serve", [r.id for r in reqs], dict(engine=engine, policy=policy, max_batch=max_batch)))
        problems = request_problems(reqs, self._require_model(), max_batch=max_batch, kv_tokens=kv_tokens)
        if problems:
            raise ValueError("bad requests:\n  - " + "\n  - ".join(problems))
        plan = self._plan or Plan(dp=self._world)
        chosen, why = serving_engine(plan, self._spec, reqs, engine, policy)
        self._stop.clear()
        records = [RequestRecord(id=r.id, rank=0, prompt=r.prompt, arrival=r.arrival, admitted=r.arrival,
                                 engine=chosen) for r in reqs]
        steps = []
        for step in range(max(r.max_new_tokens for r in reqs)):
            if self._stop.is_set():
                break
            await asyncio.sleep(self._token_delay)
            live = [(i, r) for i, r in enumerate(reqs) if step < r.max_new_tokens]
            for i, r in live:
                rec, piece = records[i], r.prompt[::-1][step % len(r.prompt)]
                rec.text, rec.tokens = rec.text + piece, step + 1
                rec.first_token = rec.first_token if step else r.arrival + 0.01
                done = step + 1 == r.max_new_tokens
                if done:
                    rec.finished, rec.finish_reason = r.arrival + 0.01 * (step + 1), "length"
                if on_token is not None:
                    on_token(TokenRecord(rank=0, prompt=i, position=step, text=piece, done=done, time=time.time()))
                if done and on_request is not None:
                    on_request(rec)
            steps += [DecodeStep(rank=rank, step=step, phase="decode", start=time.time(), time_s=0.01,
                                 tokens=len(live), running=len(live), kv_bytes=1024 * (step + 1), engine=chosen)
                      for rank in range(self._world)]
        for rec in records:
            rec.finish_reason = rec.finish_reason or "interrupted"
        result = ServeResult(engine=chosen, reason=why, policy=policy, plan=plan.describe(), wall_s=0.01 * len(steps),
                             requests=records, steps=steps)
        self._telemetry.keep_served(result)
        return result

    def quantize(self, scheme: str = "int8-weight-only") -> RecordList:
        self.calls.append(("quantize", scheme))
        plan = self._require_layout()
        problems = quantization_problems(plan, scheme, self._spec)
        if problems:
            raise ValueError("; ".join(problems))
        self._telemetry.keep_quantization([QuantizeRecord(
            rank=r, scheme=scheme, plan=plan.describe(), linears=28, params_before=1_116_416, params_after=346_624,
            kept_bytes=1_048_576, tokens_per_s_before=500.0, tokens_per_s_after=450.0, agreement=0.9)
            for r in range(self._world)])
        return self._telemetry.quantization

    def dequantize(self) -> None:
        self.calls.append(("dequantize",))
        self._require_layout()
        self._telemetry.keep_quantization([])

    def decoding(self) -> RecordList:
        return self._telemetry.decoding

    def served(self) -> ServeResult | None:
        return self._telemetry.served

    def quantized(self) -> RecordList:
        return self._telemetry.quantization

    # ---- looking at the model ----------------------------------------------------------------------
    def doctor(self) -> RecordList:
        self.calls.append(("doctor",))
        return RecordList([RankInfo(rank=r, engine_id=r, host="hostA", pid=1000 + r, local_rank=r, device="cpu",
                                    backend="gloo", threads=1, torch="2.x", transformers="5.x",
                                    world_size=self._world, barrier_ok=True, all_reduce_ok=True,
                                    all_reduce_value=10.0, bandwidth_gbps=1.5) for r in range(self._world)])

    def verify(self) -> VerifyReport:
        self.calls.append(("verify",))
        plan = self._require_layout()
        diff = 2e-8 if self._verify_ok else 3e-2
        return VerifyReport(ok=self._verify_ok, tolerance={"loss": 1e-5, "grad": 1e-5}, loss_ref=4.5,
                            loss_par=4.5 + (1e-7 if self._verify_ok else 0.2), dloss=1e-7 if self._verify_ok else 0.2,
                            max_grad_diff=diff, plan=plan.describe(),
                            params=[ParamDiff(name=n, shape=shape, max_abs_diff=diff / (1 + k))
                                    for k, (n, shape) in enumerate(PARAMS)])

    def memory(self) -> RecordList:
        self.calls.append(("memory",))
        return self._telemetry.memory()

    def comms(self, steps: int | None = None, *, raw: bool = False) -> RecordList:
        self.calls.append(("comms",))
        return self._telemetry.comms(steps, raw=raw)

    def experts(self, steps: int | None = None) -> RecordList:
        self.calls.append(("experts",))
        return self._telemetry.experts(steps)

    def timeline(self, steps: int | None = None, *, raw: bool = False) -> RecordList:
        self.calls.append(("timeline",))
        return self._telemetry.timeline(steps, raw=raw)

    def layout(self) -> RecordList:
        self.calls.append(("layout",))
        self._require_layout()
        return RecordList(self._shards())

    def _shards(self) -> list[ShardRecord]:
        return [ShardRecord(param=n, rank=r, global_shape=shape, local_shape=shape, placements=["Replicate()"],
                            mesh_axes=["dp"], coords={"dp": r}, index=[[0, d] for d in shape])
                for n, shape in PARAMS for r in range(self._world)]

    def fetch(self, name: str, rank: int = 0, *, full: bool = False, what: TensorKind = "param",
              limit_bytes: int = FULL_LIMIT_BYTES) -> Fetched:
        """Made-up values (0.01 steps from 0, the same block on every rank), the layout's records."""
        import torch

        self.calls.append(("fetch", name, rank, full, what))
        self._require_layout()
        shard = next(r for r in self._shards() if r.param == name and r.rank == rank)
        values = torch.arange(math.prod(shard.global_shape), dtype=torch.float32).reshape(shard.global_shape) / 100
        return Fetched(name, what, None if full else rank, values, [shard])

    async def stacks_async(self, *, all_threads: bool = False, timeout: float = ANSWER_S) -> RecordList:
        """Rank 3 does not answer; the others sit in an all_reduce under a made-up decoder layer
        while training runs, idle otherwise."""
        self.calls.append(("stacks", all_threads, timeout))
        busy = self._training
        frames = [FrameRecord(file="/pkg/interactive_parallel/runtime/loop.py", line=40, function="train", own=True),
                  FrameRecord(file="/site-packages/transformers/llama.py", line=120, function="forward",
                              module="model.layers.0.mlp"),
                  FrameRecord(file="/site-packages/torch/distributed/distributed_c10d.py", line=2900,
                              function="all_reduce")] if busy else []
        rows = [StackRecord(rank=r, thread="MainThread", main=True, frames=frames,
                            collective="all_reduce" if busy else "") for r in range(min(self._world, 3))]
        rows += [StackRecord(rank=r, error=f"did not answer within {timeout:g} s") for r in range(3, self._world)]
        return RecordList(rows, columns=STACK_COLUMNS)

    async def collectives_async(self, last: int = 20, *, timeout: float = ANSWER_S) -> RecordList:
        """Ranks 0-2 of the world group (rank 3 does not answer): all_reduces #56 and #57, and while
        training runs ranks 0 and 2 wait in #58, which rank 1 never issued."""
        self.calls.append(("collectives", last, timeout))
        seqs = {r: [56, 57] + ([58] if self._training and r != 1 else []) for r in range(min(self._world, 3))}
        rows = [CollectiveRecord(rank=r, group="world", seq=q, op="all_reduce", ranks=list(range(self._world)),
                                 in_sizes=[[256]], time=float(q)) for r, qs in seqs.items() for q in qs[-last:]]
        return RecordList(rows, columns=COLLECTIVE_COLUMNS)

    def dry_run(self, plan: Plan | None = None, world: int | None = None, **kwargs: Any) -> DryRun:
        """Every rank of `plan` 'simulated': memory as predicted, one tp or dp all_reduce, every
        parameter whole (no torch: the records are made up, the DryRun is the real class)."""
        self.calls.append(("dry_run", plan))
        plan = plan or self._plan or Plan(dp=self._world)
        check(plan, plan.world_size if world is None else world, self._require_model())
        axis = "tp" if plan.tp > 1 else "dp"
        simulated = {}
        for m in predict_memory(self._spec, plan):
            group = [r for r in range(plan.world_size) if r // plan.tp == m.rank // plan.tp] if axis == "tp" \
                else list(range(plan.world_size))
            comm = CommRecord(rank=m.rank, step=0, op="all_reduce", bytes=1024, axis=axis, group=group)
            shards = [ShardRecord(param=n, rank=m.rank, global_shape=shape, local_shape=shape, placements=[],
                                  mesh_axes=[], coords={}, index=[[0, d] for d in shape]) for n, shape in PARAMS]
            step = StepRecord(rank=m.rank, step=0, loss=float("nan"), tokens=0, time_s=0.0, plan=plan.describe())
            simulated[m.rank] = Simulated(memory=replace(m, step=0), comms=[comm], shards=shards, placements={},
                                          step=step, seconds=0.0)
        return DryRun(spec=self._spec, plan=plan, classes={r: r for r in simulated}, simulated=simulated)

    def predict_memory(self, plan: Plan | None = None) -> RecordList:
        self.calls.append(("predict_memory", plan))
        return RecordList(predict_memory(self._require_model(), plan or self._plan or Plan(dp=self._world)))

    # ---- step time ----------------------------------------------------------------------------------
    async def calibrate_async(self, *, precisions: Sequence[str] | None = None, repeats: int = 5) -> HardwareProfile:
        self.calls.append(("calibrate", precisions, repeats))
        self._require_model()  # calibration times matmuls at the model's shapes
        self._calibrated = replace(PROFILES["cpu"], name=f"calibrated {self._world} x cpu",
                                   source=f"fake calibration of {self._world} ranks")
        return self._calibrated

    def calibrate(self, *, precisions: Sequence[str] | None = None, repeats: int = 5) -> HardwareProfile:
        return asyncio.run(self.calibrate_async(precisions=precisions, repeats=repeats))

    def _profile(self, profile: str | HardwareProfile | None) -> str | HardwareProfile:
        return profile or self._calibrated or ("cpu" if self.device == "cpu" else "h100")

    def predict_step(self, plan: Plan | None = None, profile: str | HardwareProfile | None = None) -> StepPrediction:
        """plan/steptime's prediction; for the applied plan, the median of its steps after the first beside it."""
        self.calls.append(("predict_step", plan, profile))
        plan = plan or self._plan or Plan(dp=self._world)
        pred = predict_step(self._require_model(), plan, self._profile(profile))
        measured = [t for _, t in step_times(self.history, plan.describe())][1:] if plan == self._plan else []
        if measured:
            pred.measured_s = statistics.median(measured)
        return pred

    def search_plans(self, profile: str | HardwareProfile | None = None, *, memory_per_rank: int | None = None,
                     world: int | None = None, top: int | None = 20, **fixed: Any) -> RecordList:
        self.calls.append(("search_plans", profile, dict(memory_per_rank=memory_per_rank, world=world, top=top,
                                                         **fixed)))
        plan = self._plan or Plan(dp=self._world)
        knobs = {k: fixed.pop(k, getattr(plan, k)) for k in ("batch_size", "seq_len")}
        return search_plans(self._require_model(), world or self._world, self._profile(profile),
                            memory_per_rank=memory_per_rank, top=top, **knobs, **fixed)

    # ---- files, your code, the end ------------------------------------------------------------------
    def save(self, path: str) -> str:
        self.calls.append(("save", path))
        self._require_layout()
        return f"/abs/{path}"

    def load(self, path: str, *, keep_quantization: bool = False) -> str:
        self.calls.append(("load", path))
        self._require_layout()
        return f"/abs/{path}"

    def export_script(self, path: str, steps: int = 10) -> str:
        self.calls.append(("export_script", path))
        self._require_layout()
        return f"/abs/{path}"

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """fn here, once; an exception comes back as rank 2's RankError (what a remote failure looks like)."""
        self.calls.append(("run", fn))
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised the way Session raises a rank's failure
            raise RankError(2, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)),
                            host="hostA", what=getattr(fn, "__name__", "run")) from None
        return [value] * self._world

    def stop(self) -> None:
        self.calls.append(("stop",))
        self._alive = False

    def _require_model(self) -> ModelSpec:
        if self._spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        return self._spec

    def _require_layout(self) -> Plan:
        if self._spec is None or self._plan is None:
            raise SessionError("no model laid out: call load_model(...) and apply(Plan(...)) first")
        return self._plan
