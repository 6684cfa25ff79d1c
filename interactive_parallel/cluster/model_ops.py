"""The model as the client knows it, and every action on it: load, lay out, train, generate,
serve, quantize, verify, checkpoints, export, layout, probes and debug mode.

Owns the client's view of the model (spec, plan, debug mode, quantization), the checks that
refuse bad input before any rank is touched (a plan, a model too large for the ranks'
machines, a checkpoint of another model), the session's scratch directory through which
the ranks move state (re-plans, snapshots every `snapshot_every` steps), and turning the
ranks' streamed records into steps (a step is complete when every rank has reported it)
that land in the telemetry store and reach `on_step` while the ranks keep going. It is the
rank set's Relayout hook: around a re-formed process group it has the ranks keep their
shards and, when ranks were replaced, restores the newest snapshot. Knows nothing of
pools, engines or widgets; the rank set carries its calls.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..plan import ModelSpec, Plan, PlanError, check, resolve_model
from ..plan.inference import quantization_problems, request_problems, serving_engine
from ..records import (DecodeStep, RecordList, Request, RequestRecord, ServeResult, StepRecord, TokenRecord,
                       VerifyReport)
from ..runtime import api, atomic_dir
from .errors import SessionError
from .rankset import RankSet
from .scratch import Scratch
from .telemetry import STEP_COLUMNS, Telemetry

MANIFEST = "interactive_parallel.json"
SNAPSHOT_EVERY = 20
"""Default steps between recovery snapshots. Measured (bench/bench_state.py, 2 shared cores):
a snapshot of weights and AdamW state costs 0.2-0.6 training steps of tiny-llama and
0.1-0.2 of small-llama (4 ranks, batch 8x64), so every 20 steps adds at most ~3 % and a
failure loses at most 19 steps."""


class MemoryRefused(PlanError, SessionError):
    """A plan or model predicted not to fit the ranks' machines; `problems` has the numbers.
    A PlanError too: like every plan refusal it comes before the layout changes."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        Exception.__init__(self, "refused before loading: predicted memory exceeds what the ranks have:\n  - "
                         + "\n  - ".join(self.problems))


def refuse_replacing(path: str) -> None:
    """Saving replaces what is at `path` only when it is a checkpoint (or nothing, or empty)."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory: not replacing it with a checkpoint")
    entries = os.listdir(path)
    if entries and not ({MANIFEST, ".metadata"} & set(entries)):
        raise FileExistsError(f"{path} holds files that are not a checkpoint ({', '.join(sorted(entries)[:5])}"
                              f"{', ...' if len(entries) > 5 else ''}): saving would replace them; pick another path")


class CheckpointError(SessionError):
    """A checkpoint that does not fit the loaded model; `problems` names the parameters."""

    def __init__(self, message: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{message}:\n  - " + "\n  - ".join(self.problems))


@dataclass
class ModelOps:
    """The laid-out model of one session (see the module docstring)."""

    ranks: RankSet
    telemetry: Telemetry
    spec: ModelSpec | None = None
    plan: Plan | None = None
    debug: bool = False
    quantization: str | None = None
    """The torchao scheme the ranks' model is quantized with (None: full precision)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set by interrupt(): the running train/generate stops at the ranks' next boundary."""
    scratch: Scratch = field(default_factory=Scratch)
    """Where the ranks move state through files (re-plans, snapshots)."""
    snapshot_every: int = SNAPSHOT_EVERY
    """Steps between recovery snapshots during train (0: none)."""
    restored: dict = field(default_factory=dict)
    """How the last lay-out got its state: {'state': 'seed'|'carried'|'kept'|'snapshot', 'step'}."""
    _kept: list[int | None] = field(default_factory=list)
    _shared: bool = False
    _shared_checked: tuple | None = None

    # ---- checks (no rank touched) ---------------------------------------------------------------
    def check_plan(self, plan: Plan) -> Plan:
        problems = []
        if plan.device != self.ranks.device:
            problems.append(f"plan device {plan.device!r} != session device {self.ranks.device!r}")
        try:
            check(plan, self.ranks.world_size, self.spec)
        except PlanError as exc:
            problems = exc.problems + problems
        if problems:
            raise PlanError(problems)
        return plan

    def default_plan(self) -> Plan:
        return Plan(dp=self.ranks.world_size, device=self.ranks.device)

    def require_model(self) -> ModelSpec:
        if self.spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        return self.spec

    def require_layout(self) -> Plan:
        if self.spec is None or self.plan is None:
            raise SessionError("no model laid out: call load_model(...) and apply(Plan(...)) first")
        return self.plan

    async def shared_scratch(self) -> str | None:
        """The scratch directory's path when every rank can read it, else None. Ranks on one
        host share it; ranks on several hosts are asked (once per rank set; the caller has
        `require`d them) whether they see a file the client wrote there (a shared file
        system, or hosts that are one machine)."""
        hosts = {r.get("host") for r in self.ranks.info}
        path = self.scratch.path
        if self.ranks.pool is not None and self.ranks.pool.owned:  # its leash outwaits the writers
            self.scratch.watch([r["pid"] for r in self.ranks.info])
        if len(hosts) <= 1:
            return path
        key = (path, tuple(r.get("engine_id") for r in self.ranks.info))
        if self._shared_checked != key:
            token = os.path.join(path, ".shared")
            with open(token, "w") as f:
                f.write("scratch")
            self._shared = all(await self.ranks.call(os.path.isfile, (token,), what="scratch check"))
            self._shared_checked = key
        return path if self._shared else None

    async def scratch_for_replan(self) -> str:
        path = await self.shared_scratch()
        if path is None:
            hosts = sorted({str(r.get("host")) for r in self.ranks.info})
            raise SessionError(f"the ranks run on {len(hosts)} hosts ({', '.join(hosts)}) that do not share "
                               f"{self.scratch.path}: a re-plan moves the state through files every rank reads; "
                               "pass Session(state_dir=<a path on a file system they share>)")
        return path

    async def check_fits(self, spec: ModelSpec, plan: Plan, replan: bool = True) -> None:
        """Refuse (MemoryRefused, naming predicted and available bytes) a layout predicted not to
        fit the ranks' machines; asks the ranks what is free (changing nothing). replan=False:
        the layout stays (new training knobs), so no state is staged on the way."""
        from ..plan.fit import memory_problems

        facts = await self.ranks.call(api.host_memory, what="memory check")
        current = (self.spec, self.plan) if self.spec is not None and self.plan is not None else None
        problems = memory_problems(spec, plan, facts, current, staged_on_host=replan)
        if problems:
            raise MemoryRefused(problems)

    def check_debug_plan(self, plan: Plan | None, turning_on: bool = False) -> None:
        """DDP segfaults the engines when its group is a DETAIL debug wrapper (measured, torch
        2.13 CPU: constructing DistributedDataParallel dies with SIGSEGV); refuse it here."""
        if plan is not None and (self.debug or turning_on) and plan.dp > 1 and plan.world_size == plan.dp:
            raise SessionError(f"debug mode cannot run plan {plan.describe()}: DDP crashes under "
                               "TORCH_DISTRIBUTED_DEBUG=DETAIL on this torch; use Plan(fsdp=...) "
                               "(or dp combined with another axis) while debugging")

    def check_prompts(self, prompts: list, max_new_tokens: Any, temperature: float, top_k: int) -> None:
        spec = self.require_model()
        problems = []
        if not prompts:
            problems.append("no prompts given")
        if any(not isinstance(p, str) or not p for p in prompts):
            problems.append("every prompt must be a non-empty string")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            problems.append(f"max_new_tokens({max_new_tokens}) must be >= 1")
        elif prompts and all(isinstance(p, str) for p in prompts):
            longest = max(len(p) for p in prompts)  # one token per character
            if longest + max_new_tokens > spec.max_positions:
                problems.append(f"longest prompt({longest}) + max_new_tokens({max_new_tokens}) > "
                                f"{spec.name} max positions({spec.max_positions})")
        if temperature <= 0:
            problems.append(f"temperature({temperature}) must be > 0")
        if top_k < 0:
            problems.append(f"top_k({top_k}) must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    def check_quantization(self, scheme: str, plan: Plan, spec: ModelSpec) -> None:
        problems = quantization_problems(plan, scheme, spec)
        if problems:
            raise ValueError("; ".join(problems))

    def refuse_quantized(self, what: str) -> None:
        if self.quantization is not None:
            raise SessionError(f"the model is quantized ({self.quantization}): {what} needs full-precision "
                               "weights; call dequantize() (or apply a plan, or load a checkpoint) first")

    def check_requests(self, requests: Any, max_batch: int, kv_tokens: int | None) -> list[Request]:
        """Request objects (from Requests, dicts, or bare prompt strings), or ValueError listing
        every problem."""
        spec = self.require_model()
        items = [requests] if isinstance(requests, (str, Request, dict)) else list(requests)
        reqs = []
        for i, r in enumerate(items):
            if isinstance(r, str):
                r = Request(id=str(i), prompt=r)
            elif isinstance(r, dict):
                r = Request(**r)
            elif not isinstance(r, Request):
                raise TypeError(f"request {i} is a {type(r).__name__}: give Request objects, dicts or prompts")
            reqs.append(dataclasses.replace(r, stop=list(r.stop)))
        problems = request_problems(reqs, spec, max_batch=max_batch, kv_tokens=kv_tokens)
        if problems:
            raise ValueError("bad requests:\n  - " + "\n  - ".join(problems))
        return reqs

    # ---- laying out -----------------------------------------------------------------------------
    async def load_model(self, model: Any) -> ModelSpec:
        spec = resolve_model(model)  # unknown names fail here, before any rank is touched
        if self.plan is not None:
            check(self.plan, self.ranks.world_size, spec)
        await self.ranks.require()
        if self.plan is not None:
            await self.check_fits(spec, self.plan)
        await self.ranks.call(api.load_model, (spec,), what="load_model")
        self.forget_snapshots()  # they hold the previous model's training, not this one's
        self.spec = spec
        self.quantization = None
        self.telemetry.keep_quantization([])
        self.telemetry.plan_changed()
        if self.plan is not None:
            self.restored = (await self.ranks.call(api.apply_plan, (self.plan,), what="apply"))[0]
        return spec

    async def apply(self, plan: Plan, keep_quantization: bool = False) -> Plan:
        self.check_plan(plan)
        self.check_debug_plan(plan)
        spec = self.require_model()
        scheme = self.quantization if keep_quantization else None
        if scheme is not None:
            self.check_quantization(scheme, plan, spec)
        await self.ranks.require()
        scratch = await self.scratch_for_replan() if self.plan is not None else None
        await self.check_fits(spec, plan)
        infos = await self.ranks.call(api.apply_plan, (plan, scratch), what="apply")
        self.plan, self.restored = plan, infos[0]
        self.telemetry.plan_changed()
        await self._after_full_precision(scheme)
        return plan

    async def _after_full_precision(self, scheme: str | None) -> None:
        """The ranks just went back to full precision (apply, load): quantize again if asked."""
        self.quantization = None
        self.telemetry.keep_quantization([])
        if scheme is not None:
            await self.quantize(scheme)

    # ---- long calls ---------------------------------------------------------------------------------
    async def train(self, steps: int, on_step: Callable[[list[StepRecord]], None] | None = None,
                    snapshot_every: int | None = None, **knobs: Any) -> RecordList:
        every = self.snapshot_every if snapshot_every is None else snapshot_every
        problems = [f"{name}({value!r}) must be a whole number >= 0" for name, value in
                    (("steps", steps), ("snapshot_every", every))
                    if not isinstance(value, int) or isinstance(value, bool) or value < 0]
        if problems:
            raise PlanError(problems)
        self.require_model()
        self.refuse_quantized("train")
        self.stop.clear()
        base = self.plan or self.default_plan()
        plan = self.check_plan(base.replace(**{k: v for k, v in knobs.items() if v is not None}))
        if self.plan is None:
            await self.apply(plan)
        elif plan != self.plan:
            await self.ranks.require()
            # A larger batch or sequence is more activation memory: asked before it is run.
            await self.check_fits(self.spec, plan, replan=False)
            await self.ranks.call(api.update_training, (plan,), what="update_training")
            self.plan = plan
        out = RecordList(columns=STEP_COLUMNS)
        if steps == 0:
            return out
        await self.ranks.require()
        scratch = await self.shared_scratch() if every else None
        if every and scratch is None:
            import warnings

            warnings.warn(f"no snapshots: the ranks' hosts do not share {self.scratch.path}, so after a rank dies "
                          "the model restarts from its seed; pass Session(state_dir=<a shared path>) to keep them")
            every = 0
        world = self.ranks.world_size
        waiting: dict[int, dict[int, StepRecord]] = {}

        def complete(batch: list[StepRecord]) -> None:
            self.telemetry.add_step(batch)
            out.extend(batch)
            if on_step is not None:
                on_step(batch)

        def on_item(rank: int, rec: StepRecord) -> None:
            step = waiting.setdefault(rec.step, {})
            step[rank] = rec
            if len(step) == world:
                complete([step[r] for r in sorted(step)])
                del waiting[rec.step]

        try:
            await self.ranks.stream(api.train, (steps, every, scratch), on_item, what="train", stop=self.stop)
        finally:
            for step in sorted(waiting):  # a failed run: keep what the ranks did report
                complete([waiting[step][r] for r in sorted(waiting[step])])
        return out

    def interrupt(self) -> None:
        self.stop.set()
        self.ranks.abort()

    async def generate(self, prompts: str | Sequence[str], max_new_tokens: int, *, do_sample: bool = False,
                       temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                       on_token: Callable[[TokenRecord], None] | None = None) -> list[str]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.check_prompts(prompts, max_new_tokens, temperature, top_k)
        self.stop.clear()
        if self.plan is None:
            await self.apply(self.default_plan())
        options = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, seed=seed)
        steps: list[DecodeStep] = []

        def on_item(_rank: int, rec) -> None:
            rec = self.telemetry.on_client_clock(rec)  # its time on this client's clock
            if isinstance(rec, DecodeStep):
                steps.append(rec)
            elif on_token is not None:
                on_token(rec)

        try:
            parts = await self.ranks.stream(api.generate, (prompts, max_new_tokens, options), on_item,
                                            what="generate", stop=self.stop)
        finally:
            self.telemetry.keep_decoding(steps)
        merged: dict[int, str] = {}
        for part in parts:
            steps.extend(part.steps)
            for i, text in part.texts.items():
                merged.setdefault(int(i), text)
        self.telemetry.keep_decoding(steps)
        return [merged.get(i, "") for i in range(len(prompts))]

    async def serve(self, requests: Any, *, engine: str = "auto", policy: str = "continuous", max_batch: int = 8,
                    kv_tokens: int | None = None, on_token: Callable[[TokenRecord], None] | None = None,
                    on_request: Callable[[RequestRecord], None] | None = None,
                    on_step: Callable[[DecodeStep], None] | None = None) -> ServeResult:
        reqs = self.check_requests(requests, max_batch, kv_tokens)
        plan = self.plan or self.default_plan()
        chosen, why = serving_engine(plan, self.spec, reqs, engine, policy)
        self.stop.clear()
        if self.plan is None:
            await self.apply(plan)
        options = dict(engine=chosen, reason=why, policy=policy, max_batch=max_batch, kv_tokens=kv_tokens)
        steps: list[DecodeStep] = []
        listeners = {TokenRecord: on_token, RequestRecord: on_request, DecodeStep: on_step}

        def on_item(_rank: int, rec) -> None:
            if isinstance(rec, (TokenRecord, DecodeStep)):
                rec = self.telemetry.on_client_clock(rec)  # its time on this client's clock
            if isinstance(rec, DecodeStep):
                steps.append(rec)
            listener = listeners.get(type(rec))
            if listener is not None:
                listener(rec)

        parts = await self.ranks.stream(api.serve, (reqs, options), on_item, what="serve", stop=self.stop)
        order = {r.id: i for i, r in enumerate(reqs)}
        done = sorted((r for part in parts for r in part.requests), key=lambda r: order[r.id])
        result = ServeResult(engine=chosen, reason=why, policy=policy, plan=plan.describe(),
                             wall_s=max(p.wall_s for p in parts), requests=done,
                             steps=sorted(steps + [x for p in parts for x in p.steps], key=lambda r: (r.step, r.rank)))
        self.telemetry.keep_served(result)
        return result

    async def quantize(self, scheme: str) -> RecordList:
        plan = self.require_layout()
        self.check_quantization(scheme, plan, self.spec)
        await self.ranks.require()
        records = await self.ranks.call(api.quantize, (scheme,), what="quantize")
        self.quantization = scheme
        self.telemetry.keep_quantization(records)
        return self.telemetry.quantization

    async def dequantize(self) -> None:
        self.require_layout()
        await self.ranks.require()
        await self.ranks.call(api.dequantize, what="dequantize")
        self.quantization = None
        self.telemetry.keep_quantization([])

    # ---- looking at the model -------------------------------------------------------------------------
    async def verify(self) -> VerifyReport:
        plan = self.require_layout()
        self.refuse_quantized("verify")
        await self.ranks.require()
        report = (await self.ranks.call(api.verify, what="verify"))[0]
        return dataclasses.replace(report, plan=plan.describe())

    async def layout(self) -> RecordList:
        self.require_layout()
        if self.telemetry.shards is None:
            await self.ranks.require()
            per_rank = await self.ranks.call(api.layout, what="layout")
            self.telemetry.keep_layout([r for rank_records in per_rank for r in rank_records])
        return self.telemetry.shards

    async def set_probes(self, flag: bool) -> None:
        await self.ranks.require()
        await self.ranks.call(api.set_probes, (bool(flag),), what="set_probes")

    async def set_debug(self, flag: bool) -> None:
        if flag:
            self.check_debug_plan(self.plan, turning_on=True)
        await self.ranks.require()
        kept = await self.ranks.call(api.keep_local, what="set_debug")
        await self.ranks.call(api.set_debug, (bool(flag),), what="set_debug")
        await self.ranks.form_group()
        if self.spec is not None and self.plan is not None:
            restore = "kept" if None not in kept and len(set(kept)) == 1 else "snapshot"
            scratch = await self.shared_scratch() if restore == "snapshot" and self.scratch.created else None
            infos = await self.ranks.call(api.apply_plan, (self.plan, scratch, restore), what="apply")
            self.restored = infos[0]
        self.debug = bool(flag)

    # ---- files ---------------------------------------------------------------------------------------
    async def save(self, path: str) -> str:
        """Written under a temporary name beside `path` (runtime.atomic_dir), manifest last, then
        moved into place: an interrupted save leaves the previous checkpoint at `path` whole and
        its own files under `<path>.partial-<token>` (removed by the next save of `path`)."""
        plan = self.require_layout()
        self.refuse_quantized("save")
        path = os.path.abspath(path)  # the ranks' working directory is not ours
        refuse_replacing(path)
        await self.ranks.require()
        atomic_dir.remove_partials(path)
        staging = atomic_dir.staging_path(path)
        os.makedirs(staging)
        try:
            info = (await self.ranks.call(api.save_checkpoint, (staging,), what="save"))[0]
            manifest = {"model": dataclasses.asdict(self.spec), "plan": plan.to_dict(),
                        "tensors": info.get("tensors"), "optimizer": info.get("optimizer"), "step": info.get("step")}
            with open(os.path.join(staging, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
            atomic_dir.publish(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return path

    async def load(self, path: str, keep_quantization: bool = False) -> str:
        path = os.path.abspath(path)
        manifest_path = os.path.join(path, MANIFEST)
        if atomic_dir.is_partial(path):
            raise CheckpointError(f"{path} is an interrupted save, never completed", [
                "a checkpoint is written under this temporary name and moved into place only when complete; "
                "load the checkpoint at its own name instead"])
        if not os.path.isfile(manifest_path):
            left = atomic_dir.partials(path)
            raise FileNotFoundError(f"{path} holds no checkpoint of this package ({MANIFEST} missing)"
                                    + (f"; {', '.join(left)}: an interrupted save of it" if left else ""))
        with open(manifest_path) as f:
            saved = json.load(f)["model"]
        spec = self.require_model()
        self.require_layout()
        scheme = self.quantization if keep_quantization else None
        if saved.get("config") != spec.config:
            from ..plan.estimate import param_inventory, parameter_mismatches

            theirs = {p.name: p.shape for p in param_inventory(ModelSpec(**saved))}
            ours = {p.name: p.shape for p in param_inventory(spec)}
            raise CheckpointError(f"checkpoint {path} is of model {saved.get('name')!r}, not the loaded "
                                  f"{spec.name!r} (load_model the same model first)",
                                  parameter_mismatches(ours, theirs) or ["same parameters, another config"])
        await self.ranks.require()
        problems = (await self.ranks.call(api.checkpoint_problems, (path,), ranks=[0], what="load"))[0]
        if problems:
            raise CheckpointError(f"checkpoint {path} does not fit the loaded {spec.name!r}", problems)
        await self.ranks.call(api.load_checkpoint, (path,), what="load")
        await self.snapshot_now()  # a rank that dies next resumes from what was just loaded
        await self._after_full_precision(scheme)
        return path

    # ---- recovery snapshots ---------------------------------------------------------------------------
    def forget_snapshots(self) -> None:
        """The snapshots belong to the model trained so far: after another model is loaded a
        dead rank's replacement must not resume from them."""
        if self.scratch.created:
            shutil.rmtree(os.path.join(self.scratch.path, "snapshots"), ignore_errors=True)

    async def snapshot_now(self) -> None:
        """A snapshot of the state as it is (after a checkpoint replaced it), when snapshots are on."""
        scratch = await self.shared_scratch() if self.snapshot_every else None
        if scratch is not None:
            await self.ranks.call(api.take_snapshot, (scratch,), what="snapshot")

    async def export_script(self, path: str, steps: int) -> str:
        """The script at `path`, and beside it (`<name>_state/`) the ranks' current weights,
        optimizer state and step, from which the script resumes."""
        from ..runtime.export import script_text

        plan = self.require_layout()
        per_host: dict[str, int] = {}
        for info in self.ranks.info:
            per_host[info["host"]] = per_host.get(info["host"], 0) + 1
        path = os.path.abspath(path)
        state = os.path.splitext(path)[0] + "_state"
        text = script_text(self.spec, plan, steps, timeout_s=self.ranks.collective_timeout,
                           per_host=list(per_host.values()),
                           state_dir=os.path.basename(state))  # refuses bad steps before the ranks save
        await self.save(state)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
        return path

    # ---- Relayout: around a re-formed process group -------------------------------------------------
    async def before_reform(self, survivors: list[int]) -> None:
        """Each surviving rank keeps its own shards (no copy): enough when no rank is replaced."""
        self._kept = await self.ranks.call(api.keep_local, ranks=survivors, what="recover") if survivors else []

    async def after_reform(self, replaced: bool) -> None:
        """Lay the model out again: from the kept shards when every rank is the one it was and
        all of them hold the same step (a failure inside a step can leave a rank that finished
        it beside peers that did not), else from the newest snapshot (the seed, with a
        warning, when there is none)."""
        if self.spec is None or self.plan is None:
            return
        kept = not replaced and bool(self._kept) and None not in self._kept and len(set(self._kept)) == 1
        restore = "kept" if kept else "snapshot"
        scratch = await self.shared_scratch() if restore == "snapshot" and self.scratch.created else None
        await self.ranks.call(api.load_model, (self.spec,), what="load_model")
        infos = await self.ranks.call(api.apply_plan, (self.plan, scratch, restore), what="apply")
        self.restored = infos[0]
        if self.restored.get("state") == "seed":
            import warnings

            warnings.warn("no snapshot of the training state survived the failure: the model restarts from its "
                          "seed (snapshots are taken every snapshot_every steps of train)")
        self.telemetry.plan_changed()
        if self.quantization is not None:  # the ranks rebuilt it in full precision
            await self.ranks.call(api.quantize, (self.quantization,), what="quantize")

    def close(self) -> None:
        self.scratch.close()
