"""Session: the client's handle on a pool of ranks, from a notebook, a script or the CLI.

Owns the public surface and nothing behind it: a Session composes the rank set (engines, process
group, calls: cluster/rankset.py), built with its recovery collaborator (cluster/recovery.py),
the telemetry store (every record the ranks sent: cluster/telemetry.py) and the model operations
(cluster/model_ops.py), and declares every attribute in one place; its serving calls
(cluster/session_serving.py), its planning calls (cluster/session_planning.py) and its
debugging calls (cluster/session_debugging.py) are mixins that read those attributes (annotated
there, assigned only here). Each remote action is written once as a coroutine `name_async`; its
blocking twin `name` (what workshops type) is made by `blocking_twins`. Bad input is refused
before any rank is touched. Never imports torch or widgets: a kernel that only drives ranks stays
light, and the panel is `interactive_parallel.panel(session)`.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Sequence

from ..plan import ModelSpec, Plan
from ..records import FaultKind, FaultPlace, FaultSpec, GenerateOptions, RecordList, StepRecord, TokenRecord, VerifyReport
from ..records.stacks import RECORDER_ENTRIES
from ..runtime import api
from .calibration import Planner
from .checks import check_session_args
from .clocks import CLOCK_COLUMNS
from .errors import SessionError
from .model_ops import SNAPSHOT_EVERY, ModelOps
from .pool import AttachedPool, LocalPool, Pool
from .rankset import RankSet
from .recovery import ModelState, Recovery
from .scratch import Scratch
from .session_debugging import SessionDebugging
from .session_planning import SessionPlanning
from .session_serving import SessionServing
from .telemetry import Telemetry
from .twins import blocking_twins, run_sync

_LIVE: "weakref.WeakSet[Session]" = weakref.WeakSet()
"""Sessions not yet stopped: stopped when the interpreter exits."""


@blocking_twins
class Session(SessionServing, SessionPlanning, SessionDebugging):
    """Ranks in an ipyparallel pool, each a torch.distributed process, driven from here.

    >>> with Session(ranks=4) as s:
    ...     s.load_model("tiny-llama"); s.apply(Plan(dp=4)); s.train(steps=20)
    """

    ranks: RankSet
    """The engines, their process group and the calls to them (knows no model)."""
    telemetry: Telemetry
    """Every record the ranks sent back (steps, probes, layout)."""
    model: ModelOps
    """The model as this client knows it (spec, plan) and the actions on it."""
    planner: Planner
    """The profile the ranks were calibrated to, and the step-time predictions that read it."""

    def __init__(self, ranks: int = 4, device: str = "cpu", *, threads: int | None = None,
                 timeout: float = 120.0, collective_timeout: float = 60.0, interface: str | None = None,
                 snapshot_every: int = SNAPSHOT_EVERY, state_dir: str | None = None, launch: str | None = None,
                 flight_recorder: int = RECORDER_ENTRIES, _pool: Pool | None = None):
        """A local pool of `ranks` engines (every socket on 127.0.0.1), or the attached one.

        `interface`: the network interface (e.g. 'eth0') the process group's store and gloo /
        NCCL sockets bind to on every rank; by default loopback on one host and, across hosts,
        the interface rank 0 reaches the ipyparallel controller through. `snapshot_every`: steps
        of train() between snapshots of weights and optimizer state, from which the session
        resumes after a rank dies (0: none). `state_dir`: where the ranks move state through
        files (re-plans, snapshots); default a directory on this host's tmpfs, removed at stop;
        ranks on several hosts need a path they all share. `launch`: how a local pool starts its
        engines: 'fork' (the Linux default: forked from one process that imported torch once),
        'warm' or 'plain' (ipyparallel's launcher, each engine importing torch itself).
        `flight_recorder`: collectives torch's flight recorder keeps on each rank, over all its
        groups (what `collectives()` reads; 0: off).
        """
        check_session_args(ranks, device, interface, snapshot_every, launch, flight_recorder)
        self.ranks = RankSet(None, device=device, threads=threads, timeout=timeout,
                             collective_timeout=collective_timeout, interface=interface,
                             recorder_entries=flight_recorder)
        self._start_over(Scratch(state_dir), snapshot_every)
        try:
            self.ranks.pool = _pool or LocalPool(ranks, timeout=timeout, launch=launch)
            run_sync(self.ranks.connect(expected=None if _pool else ranks))
        except BaseException:
            self.stop()
            raise
        _LIVE.add(self)

    def _start_over(self, scratch: Scratch, snapshot_every: int) -> None:
        """What this session knows of a model, as a new one knows it: no records, no model, no
        calibration. Recovery is handed to the rank set: any call through ranks.require() may
        re-form the group and lay the model out again through it."""
        self.telemetry = Telemetry(clock=lambda: self.ranks.clock_offsets())
        recovery = Recovery(ModelState(), scratch, self.telemetry)
        self.ranks.relayout = recovery
        self.model = ModelOps(self.ranks, self.telemetry, recovery, snapshot_every=snapshot_every)
        self.planner = Planner()

    async def reset_async(self) -> None:
        """Start over on the same ranks, as a new Session would but without starting one (a new
        pool imports torch again on every rank): each rank forgets its model, optimizer, plan,
        armed faults and probe switches (runtime.api.forget), and this session its records,
        calibration and scratch directory. The engines, their process group and clocks stay."""
        await self.ranks.require()
        await self.ranks.call(api.forget, what="reset")
        scratch, every = self.model.scratch.fresh(), self.model.snapshot_every
        self.model.close()
        self._start_over(scratch, every)

    @classmethod
    def attach(cls, cluster_id: str = "", profile: str | None = None, *, profile_dir: str | None = None,
               url_file: str | None = None, ranks: int | None = None, device: str = "cpu",
               interface: str | None = None, **kwargs: Any) -> "Session":
        """Use an ipyparallel cluster started elsewhere (e.g. `ipcluster start -n 8 --engines=Slurm`).

        Ranks are grouped into hosts by host name (a host's ranks are contiguous). Across hosts
        the rendezvous binds to `interface` when named (it must exist on every host), else to the
        interface rank 0 reaches the controller through. Stopping the session releases the
        ranks' process group and disconnects; the cluster itself keeps running, as it belongs
        to whoever started it. `ranks`: how many of its engines become ranks, the first by engine
        id, waiting for that many (None: every engine it has now); the others stay idle.
        """
        if ranks is not None:
            check_session_args(ranks, device, interface, kwargs.get("snapshot_every", SNAPSHOT_EVERY), None)
        pool = AttachedPool(cluster_id=cluster_id, profile=profile, profile_dir=profile_dir, url_file=url_file,
                            ranks=ranks, timeout=kwargs.get("timeout", 120.0))
        return cls(ranks=ranks or len(pool.engine_ids), device=device, interface=interface, _pool=pool, **kwargs)

    @classmethod
    def start(cls, launcher: str, ranks: int, *, controller_ip: str, hosts: dict[str, int] | None = None,
              nodes: int | None = None, ssh_args: list[str] | None = None, options: dict | None = None,
              environment: dict | None = None, device: str = "cpu", interface: str | None = None,
              **kwargs: Any) -> "Session":
        """Start an ipyparallel cluster with its own `launcher` ('slurm', 'mpi' or 'ssh') and use
        it; stopping the session stops the cluster (the job cancelled, every engine gone).

        `controller_ip`: the address the controller listens on, which every engine host must
        reach. 'slurm': `nodes` for sbatch (ranks spread evenly over them); 'mpi' and 'ssh':
        `hosts` {host: engines}; `ssh_args` reach those hosts (mpiexec's rsh agent too).
        `options`: ipyparallel's own options of the engine launcher, by its names (e.g.
        {"queue": "gpu", "timelimit": "30"} for Slurm). A launcher that cannot give the engines
        raises LaunchError naming the job or host and why, within `timeout`.
        """
        from .launchers import LaunchedPool

        check_session_args(ranks, device, interface, kwargs.get("snapshot_every", SNAPSHOT_EVERY), None)
        pool = LaunchedPool(launcher, ranks, controller_ip=controller_ip, hosts=hosts, nodes=nodes, ssh_args=ssh_args,
                            options=options, environment=environment, timeout=kwargs.get("timeout", 120.0))
        try:
            return cls(ranks=ranks, device=device, interface=interface, _pool=pool, **kwargs)
        except BaseException:
            pool.stop()  # the session's own stop has already run; the cluster must go too
            raise

    # ---- state, read through --------------------------------------------------------------------
    device = property(lambda self: self.ranks.device, doc="'cpu' (gloo) or 'cuda' (nccl).")
    world_size = property(lambda self: self.ranks.world_size, doc="Number of ranks.")
    alive = property(lambda self: self.ranks.alive, doc="False once stopped.")
    ranks_info = property(lambda self: self.ranks.places,
                          doc="Per rank a RankPlace: host, pid, cores, GPUs, engine id, local rank, interface.")
    spec = property(lambda self: self.model.spec, doc="The loaded model's ModelSpec (None: none loaded).")
    plan = property(lambda self: self.model.plan, doc="The applied Plan (None: none applied).")
    debug = property(lambda self: self.model.debug, doc="Collective debug mode on (set_debug).")
    quantization = property(lambda self: self.model.quantization,
                            doc="The torchao scheme the model runs quantized with (None: full precision).")
    history = property(lambda self: self.telemetry.history, doc="Every StepRecord so far, in order.")
    calibrated = property(lambda self: self.planner.calibrated,
                          doc="The HardwareProfile calibrate() measured (None before).")
    timeout = property(lambda self: self.ranks.timeout, doc="Seconds a remote call may take.")
    collective_timeout = property(lambda self: self.ranks.collective_timeout,
                                  doc="Seconds any collective may wait before it fails.")

    @property
    def view(self):
        """The ipyparallel DirectView of the ranks, in rank order (for %px and your own code)."""
        if not self.ranks.alive:
            raise SessionError("the session is stopped")
        return self.ranks.view

    def __repr__(self) -> str:
        state = f"{self.world_size} ranks on {self.device}" if self.alive else "stopped"
        model = self.spec.name if self.spec else "no model"
        return f"<Session {state}, {model}, plan {self.plan.describe() if self.plan else 'none'}>"

    # ---- lifecycle -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Release the ranks: tear down the process group and, for a pool this session started,
        stop every engine and the controller and delete their files."""
        self.ranks.stop()
        self.model.close()
        _LIVE.discard(self)

    close = stop

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone (killed, out of memory, crashed); the next call replaces them."""
        return self.ranks.dead_ranks()

    async def restart_ranks_async(self) -> None:
        """Replace dead ranks (local pool) or pick up the engines now in the cluster (attached),
        form a new process group and lay the model out again."""
        await self.ranks.restart()

    async def doctor_async(self) -> RecordList:
        """Per rank: host, pid, device, versions, backend, threads; a barrier, a checked
        all_reduce and a timed one (bandwidth). Printable as a table."""
        return await self.ranks.doctor()

    def clocks(self) -> RecordList:
        """Per rank: how far its clock is from this client's (ClockRecords, measured when the
        ranks connected or by measure_clocks). timeline() and comms() are corrected by them."""
        return RecordList(self.ranks.clocks, columns=CLOCK_COLUMNS)

    async def measure_clocks_async(self) -> RecordList:
        """Measure every rank's clock offset again (e.g. after a host's clock was stepped);
        records that arrive from now on are corrected by the new offsets."""
        await self.ranks.require()
        await self.ranks.measure_clocks()
        return self.clocks()

    async def run_async(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """fn(*args, **kwargs) on every rank (process group ready); the results in rank order."""
        return await self.ranks.run(fn, *args, timeout=timeout, **kwargs)

    async def inject_async(self, rank: int, fault: FaultKind, at_step: int = 0, *, where: FaultPlace = "step",
                           collective: int = 0, seconds: float = 0.0) -> FaultSpec:
        """Arm a fault on `rank` for the next train/generate/serve call, for tests and teaching:
        'kill', 'hang', 'raise', 'skip_collective' or 'slow' (`seconds`), at that call's
        `at_step`-th step boundary (0: the first) or inside the `collective`-th collective of
        that step (`where='collective'`). The failure is then reported as it would be for real."""
        return await self.ranks.inject(FaultSpec(rank=rank, fault=fault, at_step=at_step, where=where,
                                                 collective=collective, seconds=seconds))

    # ---- the model ---------------------------------------------------------------------------------
    async def load_model_async(self, model: Any = "tiny-llama") -> ModelSpec:
        """A preset name ('tiny-llama', 'small-llama', 'tiny-gpt2'), a local model directory,
        or a transformers config. Random init from the plan's seed unless weights are given."""
        return await self.model.load_model(model)

    def check_plan(self, plan: Plan) -> Plan:
        """The plan as this session would run it, or PlanError listing every problem."""
        return self.model.check_plan(plan)

    async def apply_async(self, plan: Plan, *, keep_quantization: bool = False) -> Plan:
        """Lay the model out under `plan` on the live ranks; weights, optimizer state and step carry
        over (through torch.distributed.checkpoint: no rank holds a whole copy), in full precision
        (a quantized model is quantized again under the new plan with keep_quantization). A plan
        predicted not to fit the ranks' memory is refused first, naming predicted and available bytes."""
        return await self.model.apply(plan, keep_quantization)

    async def train_async(self, steps: int = 1, *, batch_size: int | None = None, seq_len: int | None = None,
                          grad_accum: int | None = None, lr: float | None = None, precision: str | None = None,
                          max_grad_norm: float | None = None, on_step: Callable[[list[StepRecord]], None] | None = None,
                          snapshot_every: int | None = None, data: str | None = None) -> RecordList:
        """Run `steps` optimizer steps in one call to the ranks; every rank's StepRecords (also in
        .history), each carrying the memory, comms and compute intervals the probes measured.

        The records stream back while the ranks train: `on_step(records)` is called as each step
        completes on every rank. Keyword overrides (batch_size, seq_len, grad_accum, lr, precision,
        max_grad_norm) change the plan's training knobs, validated before any rank is touched. `interrupt()`
        ends every rank at the same step boundary. A rank that raises gives a RankError naming
        it; the steps done before it are kept. Every `snapshot_every` steps (default: the
        session's) the ranks snapshot weights and optimizer state: after a rank dies, the next
        call resumes from the newest snapshot.

        `data`: the text to train on, kept like the knobs for later calls and for verify() (None:
        keep the session's, at first the package's synthetic additions; 'arithmetic': back to
        them). A path to a text file (.txt, .md or no suffix), a .jsonl file with a 'text'
        string per line, or a directory written by datasets' save_to_disk (needs datasets), at
        a path every rank can read. The ranks tokenize it once with the model's tokenizer, join
        its documents with the end-of-sequence token and cut rows of seq_len + 1 tokens; a
        step's batch is the next batch_size rows of a seeded shuffle (the same for the same
        seed and step) and each data-parallel rank reads only its own. A missing, empty or
        unreadable text, or one shorter than one batch (rank 0 counts its tokens), is refused
        before any rank trains, with the numbers."""
        return await self.model.train(steps, on_step, snapshot_every, data, batch_size=batch_size, seq_len=seq_len,
                                      grad_accum=grad_accum, lr=lr, precision=precision, max_grad_norm=max_grad_norm)

    def interrupt(self) -> None:
        """Stop a running train(), generate() or serve() at the ranks' next boundary (safe from any thread)."""
        self.model.interrupt()

    async def generate_async(self, prompts: str | Sequence[str], max_new_tokens: int = 16, *,
                             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                             on_token: Callable[[TokenRecord], None] | None = None) -> list[str]:
        """Completions (strings) of one prompt or a list; greedy unless do_sample=True.
        `on_token(record)` receives each prompt's new text as the ranks decode it (its time on
        this client's clock)."""
        options = GenerateOptions(do_sample=do_sample, temperature=temperature, top_k=top_k, seed=seed)
        return await self.model.generate(prompts, max_new_tokens, options, on_token)

    async def verify_async(self) -> VerifyReport:
        """Loss and per-parameter gradient differences against one process holding the whole
        model, on the current weights and the current step's batch (of the text train(data=...)
        set, else the synthetic task; no optimizer step). The
        reference is built on rank 0 only; when it would not fit there, the report says so with
        the numbers (`note`) instead of trying."""
        return await self.model.verify()

    async def save_async(self, path: str) -> str:
        """Write weights, optimizer state and step (each rank its own shards) with
        torch.distributed.checkpoint."""
        return await self.model.save(path)

    # 5GB, not transformers' 50GB: one rank merges each output file while its peers wait at
    # torch's barrier under the collective timeout, so smaller files share that work out.
    async def save_pretrained_async(self, path: str, *, max_shard_size: int | str = "5GB") -> str:
        """Write the model as a transformers directory, which `AutoModelForCausalLM.from_pretrained(path)`
        and `AutoTokenizer.from_pretrained(path)` load (and load_model(path) too): config, generation
        config, safetensors weights under the transformers names, in files of at most
        `max_shard_size` ('5GB', '500MB' or bytes; a larger tensor alone in its own) with
        model.safetensors.index.json when there are several, and the tokenizer (the model
        directory's own, else the package's). Each rank writes its own shards and
        torch.distributed.checkpoint's consolidation merges them a tensor at a time: no rank
        holds the whole model. As for save: a non-empty path that is not ours is refused, the
        directory appears whole or not at all, ranks on several hosts need a path they all
        share; a quantized model is refused."""
        return await self.model.save_pretrained(path, max_shard_size)

    async def load_async(self, path: str, *, keep_quantization: bool = False) -> str:
        """Load weights, optimizer state and step saved under any plan into the current layout
        (resharded on load), in full precision (keep_quantization=True quantizes them again with
        the current scheme). A checkpoint of another model is refused naming its parameters."""
        return await self.model.load(path, keep_quantization)

    async def export_script_async(self, path: str, steps: int = 10) -> str:
        """Write a standalone `torchrun --nproc_per_node N` script that rebuilds this model,
        plan and training settings from interactive_parallel.runtime (no ipyparallel), and
        beside it the current weights and optimizer state, from which the script resumes."""
        return await self.model.export_script(path, steps)

    # ---- inside the ranks ----------------------------------------------------------------------------
    def memory(self) -> RecordList:
        """Per rank, bytes of params / grads / optimizer state / activation peak measured in the
        latest step (no remote call); `predict_memory()` gives the estimate beside it."""
        return self.telemetry.memory()

    def comms(self, steps: int | None = None, *, raw: bool = False) -> RecordList:
        """Every collective and p2p op each rank issued in the latest step (or the last `steps`
        steps): op, bytes (full-buffer convention), dtype, mesh axis, group, peer, start/end
        (on this client's clock; raw=True: on each rank's own clock)."""
        return self.telemetry.comms(steps, raw=raw)

    def experts(self, steps: int | None = None) -> RecordList:
        """Mixture-of-experts routing per rank and MoE layer (ExpertRecords) of the latest `steps`
        steps, all by default: experts held, pairs each processed, sent to / received from each
        ep peer (no remote call; empty for a dense model). viz.expert_load_figure draws them."""
        return self.telemetry.experts(steps)

    def timeline(self, steps: int | None = None, *, raw: bool = False) -> RecordList:
        """Comm intervals (CommRecords) and compute intervals (PipelineEvents: forward /
        backward per stage and microbatch) of the latest step (or the last `steps`), their
        times on this client's clock, so hosts line up (raw=True: each rank's own clock)."""
        return self.telemetry.timeline(steps, raw=raw)

    async def layout_async(self) -> RecordList:
        """Per parameter and rank: placements, mesh coordinates, pipeline stage and the
        [start, stop) index ranges of the full tensor the rank holds."""
        return await self.model.layout()

    async def set_probes_async(self, flag: bool) -> None:
        """Per-step probes (memory, comm ledger, compute intervals) on (default) or off."""
        await self.model.set_probes(flag)

    async def set_debug_async(self, flag: bool = True) -> None:
        """Re-form the process group with TORCH_DISTRIBUTED_DEBUG=DETAIL (or back to OFF): a
        collective whose shapes differ across ranks then raises an error naming the ranks, op
        and shapes instead of aborting the engines. Slower collectives; weights, optimizer state
        and step carry over."""
        await self.model.set_debug(flag)

    def records(self) -> list:
        """Every record the session holds (steps, the latest step's probe records, the layout)."""
        return self.telemetry.records()

    def report(self, path: str = "report.html", *, title: str = "interactive_parallel report") -> str:
        """Every figure of this session in one standalone HTML file."""
        from ..viz import figures_from_records, write_report

        if self.plan is not None and self.alive and self.ranks.running is None:
            self.layout()
        summary = (f"<p>{self.world_size} ranks on {self.device}; model {self.spec.name if self.spec else '-'}; "
                   f"plan {self.plan.describe() if self.plan else '-'}; {len(self.history)} step records</p>")
        return str(write_report(path, figures_from_records(self.records()), title=title, summary_html=summary))


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        s.stop()
