"""The model as the client knows it, and every action on it: load, lay out, train, generate,
serve, quantize, verify, checkpoints, transformers directories, export, layout, probes and
debug mode.

Owns the order of each action's steps: refuse bad input first (cluster/checks.py), ask the
ranks what memory is free before a layout that may not fit (memory admission), then the rank
calls, then the client's view of the model (`ModelState`, shared with cluster/recovery.py)
and the telemetry store. Streamed records are put together by cluster/streams.py, checkpoints
written and checked by cluster/checkpoints.py, state moved through the session's scratch
directory (cluster/scratch.py: re-plans, snapshots every `snapshot_every` steps). Every rank
call goes through `ranks.require()`, which may first recover (cluster/recovery.py) and so
lay the model out again. Knows nothing of pools, engines or widgets.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..plan import ModelSpec, Plan, PlanError, UnknownModelError, check, resolve_model
from ..plan.inference import serving_engine
from ..records import (DataSource, DecodeStep, GenerateOptions, RecordList, RequestRecord, ServeOptions,
                       ServeResult, StepRecord, TokenRecord, VerifyReport)
from ..runtime import api
from ..runtime.model.tokenizer import tokenizer_dir
from . import checkpoints, checks
from .errors import RankError, SessionError
from .lint_notes import warn_layout
from .rankset import RankSet
from .recovery import Recovery
from .streams import InferenceStream, StepAssembler
from .telemetry import Telemetry

SNAPSHOT_EVERY = 20
"""Default steps between recovery snapshots: a snapshot costs a fraction of a training step
(bench/bench_state.py), so every 20 steps adds little and a failure loses at most 19 steps."""


class MemoryRefused(PlanError, SessionError):
    """A plan or model predicted not to fit the ranks' machines; `problems` has the numbers.
    A PlanError too: like every plan refusal it comes before the layout changes."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        Exception.__init__(self, "refused before loading: predicted memory exceeds what the ranks have:\n  - "
                           + "\n  - ".join(self.problems))


@dataclass
class ModelOps:
    """The laid-out model of one session (see the module docstring)."""

    ranks: RankSet
    telemetry: Telemetry
    recovery: Recovery
    """The rank set's Relayout collaborator; its ModelState is this object's."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set by interrupt(): the running train/generate stops at the ranks' next boundary."""
    snapshot_every: int = SNAPSHOT_EVERY
    """Steps between recovery snapshots during train (0: none)."""
    data: DataSource | None = None
    """The text train and verify read, as the latest train(data=...) gave it (None: the synthetic task)."""

    state = property(lambda self: self.recovery.state, doc="What the client knows of the laid-out model.")
    scratch = property(lambda self: self.recovery.scratch,
                       doc="Where the ranks move state through files (re-plans, snapshots).")
    spec = property(lambda self: self.state.spec)
    plan = property(lambda self: self.state.plan)
    quantization = property(lambda self: self.state.quantization)
    debug = property(lambda self: self.state.debug)
    restored = property(lambda self: self.state.restored, doc="How the last lay-out got its state (LayoutInfo).")

    # ---- checks (no rank touched) ---------------------------------------------------------------
    def check_plan(self, plan: Plan) -> Plan:
        return checks.check_plan(plan, self.ranks.device, self.ranks.world_size, self.spec)

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

    # ---- laying out -----------------------------------------------------------------------------
    async def load_model(self, model: Any) -> ModelSpec:
        spec = resolve_model(model)  # unknown names fail here, before any rank is touched
        spec = await self._checked(spec)
        if self.plan is not None:
            check(self.plan, self.ranks.world_size, spec)
            await self.check_fits(spec, self.plan)
        await self.ranks.call(api.load_model, (spec,), what="load_model")
        self.scratch.forget_snapshots()  # they hold the previous model's training, not this one's
        self.state.spec, self.state.quantization = spec, None
        self.telemetry.keep_quantization([])
        self.telemetry.plan_changed()
        if self.plan is not None:
            scratch = await self.scratch.shared(self.ranks) if self.plan.compile else None  # its compile cache
            infos = await self.ranks.call(api.apply_plan, (self.plan, scratch), what="apply")
            self.state.restored = infos[0]
            warn_layout(infos)
        return spec

    async def _ask(self, fn: Callable, args: tuple, what: str,
                   refusals: dict[str, Callable[[str], Exception]] | None = None) -> Any:
        """fn(*args) on rank 0, a question that changes nothing there, asked before an action
        because the answer needs torch or the model's tokenizer (which this client does not
        load); a refusal it raises (`refusals`: the rank's exception name -> the client's
        exception from its message) comes back as this client's own error, not a RankError."""
        await self.ranks.require()
        try:
            return (await self.ranks.call(fn, args, ranks=[0], what=what))[0]
        except RankError as exc:
            make = (refusals or {}).get(exc.ename)
            if make is None:
                raise
            raise make(exc.evalue) from None

    async def _checked(self, spec: ModelSpec) -> ModelSpec:
        """`spec` checked by transformers and with its family facts: a config transformers refuses
        is refused before the ranks' model is touched, and the model and plan they have stay."""
        return await self._ask(api.checked_spec, (spec,), "load_model", {"UnknownModelError": UnknownModelError})

    async def apply(self, plan: Plan, keep_quantization: bool = False) -> Plan:
        self.check_plan(plan)
        checks.check_debug_plan(plan, self.debug)
        spec = self.require_model()
        scheme = self.quantization if keep_quantization else None
        if scheme is not None:
            checks.check_quantization(scheme, plan, spec)
        await self.ranks.require()
        scratch = await self.scratch.for_replan(self.ranks) if self.plan is not None else \
            await self.scratch.shared(self.ranks) if plan.compile else None  # compile: its cache lives there
        await self.check_fits(spec, plan)
        infos = await self.ranks.call(api.apply_plan, (plan, scratch), what="apply")
        self.state.plan, self.state.restored = plan, infos[0]
        self.telemetry.plan_changed()
        warn_layout(infos)
        await self._after_full_precision(scheme)
        return plan

    async def _after_full_precision(self, scheme: str | None) -> None:
        """The ranks just went back to full precision (apply, load): quantize again if asked."""
        self.state.quantization = None
        self.telemetry.keep_quantization([])
        if scheme is not None:
            await self.quantize(scheme)

    # ---- long calls ---------------------------------------------------------------------------------
    async def train(self, steps: int, on_step: Callable[[list[StepRecord]], None] | None = None,
                    snapshot_every: int | None = None, data: Any = None, **knobs: Any) -> RecordList:
        """`data`: a path, checks.ARITHMETIC, or None (the text of the call before)."""
        every = self.snapshot_every if snapshot_every is None else snapshot_every
        checks.check_counts(steps=steps, snapshot_every=every)
        spec = self.require_model()
        checks.refuse_quantized(self.quantization, "train")
        source = self.data if data is None else checks.check_data(data)
        self.stop.clear()
        base = self.plan or self.default_plan()
        plan = self.check_plan(base.replace(**{k: v for k, v in knobs.items() if v is not None}))
        if source is not None:  # the tokens need the model's tokenizer: rank 0 counts (and keeps) them
            def unreadable(message: str) -> Exception:  # the text as rank 0 read it
                return checks.DataError(f"data {source.path!r} on rank 0: {message}")

            tokens = await self._ask(api.data_tokens, (source,), "train",
                                     dict.fromkeys(("ValueError", "UnicodeDecodeError", "JSONDecodeError"), unreadable))
            checks.check_data_length(source, tokens, plan.batch_size, plan.seq_len, spec.name)
        self.data = source
        if self.plan is None:
            await self.apply(plan)
        elif plan != self.plan:
            await self.ranks.require()
            # A larger batch or sequence is more activation memory: asked before it is run.
            await self.check_fits(self.spec, plan, replan=False)
            await self.ranks.call(api.update_training, (plan,), what="update_training")
            self.state.plan = plan
        steps_in = StepAssembler(self.ranks.world_size, self.telemetry, on_step)
        if steps == 0:
            return steps_in.out
        await self.ranks.require()
        scratch = await self.scratch.shared(self.ranks) if every else None
        if every and scratch is None:
            warnings.warn(f"no snapshots: the ranks' hosts do not share {self.scratch.path}, so after a rank dies "
                          "the model restarts from its seed; pass Session(state_dir=<a shared path>) to keep them")
            every = 0
        try:
            await self.ranks.stream(api.train, (steps, every, scratch, source), steps_in.take, what="train",
                                    stop=self.stop)
        finally:
            steps_in.close()  # a failed run: keep what the ranks did report
        return steps_in.out

    def interrupt(self) -> None:
        self.stop.set()
        self.ranks.abort()

    async def generate(self, prompts: str | Sequence[str], max_new_tokens: int, options: GenerateOptions,
                       on_token: Callable[[TokenRecord], None] | None = None) -> list[str]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        lengths = await self._prompt_lengths(prompts)
        checks.check_prompts(prompts, max_new_tokens, options.temperature, options.top_k, self.require_model(),
                             lengths)
        self.stop.clear()
        if self.plan is None:
            await self.apply(self.default_plan())
        stream = InferenceStream(self.telemetry, {TokenRecord: on_token})
        try:
            parts = await self.ranks.stream(api.generate, (prompts, max_new_tokens, options), stream.take,
                                            what="generate", stop=self.stop)
        finally:
            self.telemetry.keep_decoding(stream.steps)
        merged: dict[int, str] = {}
        for part in parts:
            stream.steps.extend(part.steps)
            for i, text in part.texts.items():
                merged.setdefault(int(i), text)
        self.telemetry.keep_decoding(stream.steps)
        return [merged.get(i, "") for i in range(len(prompts))]

    async def _prompt_lengths(self, prompts: list) -> list[int] | None:
        """Each prompt's tokens under the model's own tokenizer, counted on rank 0 (this client
        loads no tokenizer); None for the package's (one token per character) or prompts that
        are not all strings (the checks name those)."""
        spec = self.require_model()
        if tokenizer_dir(spec) is None or not checks.prompt_strings(prompts):
            return None
        return await self._ask(api.prompt_lengths, (prompts,), "prompt check")

    async def serve(self, requests: Any, options: ServeOptions, on_token: Callable[[TokenRecord], None] | None = None,
                    on_request: Callable[[RequestRecord], None] | None = None,
                    on_step: Callable[[DecodeStep], None] | None = None) -> ServeResult:
        """`options.engine` may be 'auto' here: the client chooses (plan/inference.serving_engine)."""
        reqs = checks.as_requests(requests)
        lengths = await self._prompt_lengths([r.prompt for r in reqs])
        checks.check_requests(reqs, self.require_model(), options.max_batch, options.kv_tokens, lengths)
        plan = self.plan or self.default_plan()
        chosen, why = serving_engine(plan, self.spec, reqs, options.engine, options.policy)
        options = replace(options, engine=chosen, reason=why)
        self.stop.clear()
        if self.plan is None:
            await self.apply(plan)
        stream = InferenceStream(self.telemetry, {TokenRecord: on_token, RequestRecord: on_request,
                                                  DecodeStep: on_step})
        parts = await self.ranks.stream(api.serve, (reqs, options), stream.take, what="serve", stop=self.stop)
        order = {r.id: i for i, r in enumerate(reqs)}
        done = sorted((r for part in parts for r in part.requests), key=lambda r: order[r.id])
        result = ServeResult(engine=chosen, reason=why, policy=options.policy, plan=plan.describe(),
                             wall_s=max(p.wall_s for p in parts), requests=done,
                             steps=sorted(stream.steps + [x for p in parts for x in p.steps],
                                          key=lambda r: (r.step, r.rank)))
        self.telemetry.keep_served(result)
        return result

    async def quantize(self, scheme: str) -> RecordList:
        plan = self.require_layout()
        checks.check_quantization(scheme, plan, self.spec)
        await self.ranks.require()
        records = await self.ranks.call(api.quantize, (scheme,), what="quantize")
        self.state.quantization = scheme
        self.telemetry.keep_quantization(records)
        return self.telemetry.quantization

    async def dequantize(self) -> None:
        self.require_layout()
        await self.ranks.require()
        await self.ranks.call(api.dequantize, what="dequantize")
        self.state.quantization = None
        self.telemetry.keep_quantization([])

    # ---- looking at the model -------------------------------------------------------------------------
    async def verify(self) -> VerifyReport:
        plan = self.require_layout()
        checks.refuse_quantized(self.quantization, "verify")
        await self.ranks.require()
        report = (await self.ranks.call(api.verify, kwargs={"data": self.data}, what="verify"))[0]
        return replace(report, plan=plan.describe())

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
            checks.check_debug_plan(self.plan, debugging=True)
        await self.ranks.require()
        await self.recovery.keep(self.ranks)
        await self.ranks.call(api.set_debug, (bool(flag),), what="set_debug")
        await self.ranks.form_group()
        if self.spec is not None and self.plan is not None:
            await self.recovery.lay_out(self.ranks, self.recovery.source(replaced=False), reload=False)
        self.state.debug = bool(flag)

    # ---- files ---------------------------------------------------------------------------------------
    async def save(self, path: str) -> str:
        plan = self.require_layout()
        checks.refuse_quantized(self.quantization, "save")

        async def write(staging: str):  # checkpoints.save has refused a path it must not replace
            await self.ranks.require()
            return (await self.ranks.call(api.save_checkpoint, (staging,), what="save"))[0]

        return await checkpoints.save(path, self.spec, plan, write)

    async def save_pretrained(self, path: str, max_shard_size: int | str) -> str:
        """A transformers directory at `path` (runtime.checkpoints.hf_export), under save's rules: a path that
        is not ours refused, written under a staging name and moved into place."""
        plan = self.require_layout()
        checks.refuse_quantized(self.quantization, "save_pretrained")
        limit = checkpoints.shard_bytes(max_shard_size)

        async def write(staging: str):
            await self.ranks.require()
            return (await self.ranks.call(api.save_pretrained, (staging, limit), what="save_pretrained"))[0]

        return await checkpoints.save(path, self.spec, plan, write, kind=checkpoints.TRANSFORMERS)

    async def load(self, path: str, keep_quantization: bool = False) -> str:
        spec = self.require_model()
        self.require_layout()
        path = checkpoints.check_loadable(path, spec)
        scheme = self.quantization if keep_quantization else None
        await self.ranks.require()
        problems = (await self.ranks.call(api.checkpoint_problems, (path,), ranks=[0], what="load"))[0]
        if problems:
            raise checkpoints.CheckpointError(f"checkpoint {path} does not fit the loaded {spec.name!r}", problems)
        await self.ranks.call(api.load_checkpoint, (path,), what="load")
        await self.snapshot_now()  # a rank that dies next resumes from what was just loaded
        await self._after_full_precision(scheme)
        return path

    async def snapshot_now(self) -> None:
        """A snapshot of the state as it is (after a checkpoint replaced it), when snapshots are on."""
        scratch = await self.scratch.shared(self.ranks) if self.snapshot_every else None
        if scratch is not None:
            await self.ranks.call(api.take_snapshot, (scratch,), what="snapshot")

    async def export_script(self, path: str, steps: int) -> str:
        """The script at `path`, and beside it (`<name>_state/`) the ranks' current weights,
        optimizer state and step, from which the script resumes."""
        from ..runtime.client.export import script_text

        plan = self.require_layout()
        per_host: dict[str, int] = {}
        for place in self.ranks.places:
            per_host[place.host] = per_host.get(place.host, 0) + 1
        path = os.path.abspath(path)
        state = os.path.splitext(path)[0] + "_state"
        # script_text refuses bad steps before the ranks save
        text = script_text(self.spec, plan, steps, timeout_s=self.ranks.collective_timeout,
                           per_host=list(per_host.values()), state_dir=os.path.basename(state), data=self.data)
        await self.save(state)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
        return path

    def close(self) -> None:
        self.scratch.close()

