"""The Plan: how a model is spread over the ranks and how it is trained.

Owns the Plan dataclass (its validation against a rank count and a model spec is
plan.validate's), the mesh shape it implies and the facts derived from it once (`uses_ddp`,
the pipeline stages and their layers, the schedule's record and its order on one rank:
`schedule`, `pipeline_ops`, `schedule_order`), and what a form needs to offer its fields: each
choice field's values (`field_choices`, from its Literal type; pp_schedule's from the schedules'
records) and each field's docstring (`field_docs`). Knows nothing of any one schedule: what
differs between them is their record's (plan.schedules). Pure Python: knows no torch, no processes.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .axes import MESH_ORDER, MeshAxis
from .pipeline_order import Op
from .schedules import SCHEDULE_NAMES, SCHEDULES, PipelineSchedule, schedule_named, unknown_schedule

Device = Literal["cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp16"]
PpSchedule = Literal[SCHEDULE_NAMES]  # type: ignore[valid-type]
"""The schedules' names, from their records (plan.schedules): the panel's choices (field_choices)."""
CpMethod = Literal["allgather", "ring"]
Recompute = Literal["none", "selective", "full"]
DEVICES: tuple[str, ...] = typing.get_args(Device)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
PP_SCHEDULES: tuple[str, ...] = SCHEDULE_NAMES
CP_METHODS: tuple[str, ...] = typing.get_args(CpMethod)
RECOMPUTES: tuple[str, ...] = typing.get_args(Recompute)
TRAINING_FIELDS = ("batch_size", "seq_len", "grad_accum", "microbatches", "lr", "max_grad_norm", "seed")
"""Plan fields that do not change which shards a rank holds."""
SEED_LIMIT = 2**63
"""Seeds torch's generators take (torch.manual_seed refuses 2**64 and above)."""


def split_layers(num_layers: int, stages: int) -> list[int]:
    """Decoder layers per stage when the plan gives none: an even split, the remainder to the
    middle stages (the first also embeds, the last also holds the norm and the head: torchtitan
    weighs each as about a layer), then to the last and the first. Llama 3.1 405B's 126 layers on
    16 stages: 7, 8 x 14, 7. Fewer layers than stages leaves stages empty (validate refuses it)."""
    if stages <= 1:
        return [num_layers]
    base, extra = divmod(num_layers, stages)
    order = list(range(1, stages - 1)) + [stages - 1, 0]
    counts = [base] * stages
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


class PlanError(ValueError):
    """A plan that cannot run; `problems` lists every reason, each naming its numbers."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid plan:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel layout plus the training knobs that interact with it."""

    device: Device = "cpu"
    """'cpu' (gloo) or 'cuda' (nccl, one GPU per local rank)."""
    dp: int = 1
    """Data-parallel replicas (DDP; HSDP's replicate axis when fsdp > 1)."""
    fsdp: int = 1
    """Data-parallel shards: parameters, gradients and optimizer state split (FSDP2)."""
    tp: int = 1
    """Tensor parallel: each weight matrix split across this many ranks."""
    pp: int = 1
    """Pipeline parallel: the layers split into this many stages."""
    cp: int = 1
    """Context parallel: the sequence split across this many ranks."""
    cp_method: CpMethod = "allgather"
    """How context-parallel attention sees the other ranks' keys and values: 'allgather' (all of
    them at once, O(seq) per rank) or 'ring' (one block at a time, passed rank to rank)."""
    ep: int = 1
    """Expert parallel: each MoE layer's experts split over this many of the data-parallel ranks
    (dp x fsdp x cp), tokens sent to their experts' ranks and back; the rank count is unchanged."""
    pp_schedule: PpSchedule = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved-1f1b', zero bubble 'interleaved-zb', 'zbv' or
    'dualpipev' (torch's classes; their get_schedule_class names, such as 'ZBVZeroBubble', are accepted)."""
    microbatches: int = 0
    """Pipeline microbatches per step; 0 means one per stage (pp)."""
    virtual_stages: int = 2
    """Stages per rank for the looped schedules ('interleaved-1f1b', 'interleaved-zb'); V schedules hold 2."""
    stage_layers: tuple[int, ...] = ()
    """Decoder layers of each pipeline stage, in stage order (e.g. (7, 8, 8, 7)); empty: split evenly,
    the remainder to the middle stages (the first and last also hold the embedding and the head)."""
    sequence_parallel: bool = False
    """Under tp: shard norms and dropout along the sequence too."""
    vocab_parallel: bool = True
    """Under tp: the token embedding and the LM head split on the vocabulary, as the model's own TP
    plan does (transformers' 'embedding_rowwise' and 'colwise_gather_output'; torchtitan); False keeps
    both whole on every tp rank (a lesson's baseline)."""
    loss_parallel: bool = False
    """Under tp: the head's logits kept split on the vocabulary and the loss taken on them (never
    gathered); needs vocab_parallel."""
    compile: bool = False
    """torch.compile each decoder block for training (generation and serving run them eagerly);
    the first step pays the compile time."""
    recompute: Recompute = "none"
    """Activation recomputation per decoder layer: 'none', 'selective' (recompute the cheap
    ops, keep matmul and attention outputs) or 'full' (keep each layer's input only)."""
    batch_size: int = 8
    """Global batch (sequences per optimizer step, over all data-parallel ranks)."""
    seq_len: int = 64
    """Tokens per sequence."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; the global batch is split across them."""
    precision: Precision = "fp32"
    """'fp32', 'bf16' (autocast) or 'fp16' (autocast with a gradient scaler; CUDA only)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    max_grad_norm: float = 0.0
    """Clip the gradient to this total norm, taken over the whole model (every shard, axis and
    pipeline stage) as one process would take it; 0: no clipping (torchtitan and transformers'
    Trainer use 1.0)."""
    seed: int = 0
    """Seed of weights and data: the same seed gives the same run under every plan."""

    def __post_init__(self) -> None:
        # Spellings a user may bring from torch or from JSON, folded to the one the fields hold.
        if isinstance(self.pp_schedule, str) and self.pp_schedule not in SCHEDULES:
            named = schedule_named(self.pp_schedule)
            object.__setattr__(self, "pp_schedule", named.name if named else self.pp_schedule)
        if isinstance(self.stage_layers, list):
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.cp

    @property
    def vocab_split(self) -> bool:
        """Whether the token embedding and the LM head are split on the vocabulary over tp (decided
        here once: the runtime, the inventory, the estimates and the one-process mode read it):
        under tp, unless vocab_parallel=False keeps them whole and loss_parallel does not need them split."""
        return self.tp > 1 and (self.loss_parallel or self.vocab_parallel)

    @property
    def uses_ddp(self) -> bool:
        """Whether the model is wrapped in DDP: pure data parallelism over more than one rank.
        With any other axis beside dp (HSDP, or dp with tp / pp / cp) gradients are averaged
        by FSDP2's fully_shard or replicate instead (runtime.layout.parallelize)."""
        return self.dp > 1 and self.world_size == self.dp and self.ep == 1

    @property
    def gradient_axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(sharded, replicated): the mesh axes over which a step averages the gradients, each
        group folded into one (runtime.groups.mesh builds the meshes; plan.estimate names the groups).
        cp ranks hold the same parameters and see different tokens, so for gradients they are
        data-parallel ranks: sharded with fsdp under FSDP, else replicated with dp. Both
        non-empty: HSDP (one 2-D shard mesh, replicate x shard)."""
        shard = tuple(a for a in ("fsdp", "cp") if getattr(self, a) > 1) if self.fsdp > 1 else ()
        return shard, tuple(a for a in ("dp", "cp") if getattr(self, a) > 1 and a not in shard)

    @property
    def gathers_bf16(self) -> bool:
        """Whether FSDP gathers bf16 parameters (torchtitan's `param_dtype=bfloat16`): bf16
        under any sharded axis. The units then compute in bf16 (the residual stream, every
        collective of their activations) and reduce their gradients in fp32 onto fp32 shards, the
        optimizer's master weights. Elsewhere bf16 is autocast over fp32 parameters."""
        return self.precision == "bf16" and bool(self.gradient_axes[0])

    @property
    def replicates_gradients(self) -> bool:
        """Whether a replicated wrapper averages the gradients: DDP (uses_ddp), or FSDP2's
        replicate over the dp and cp ranks when nothing is sharded. Under fsdp (HSDP too) the
        gradients go through fully_shard instead."""
        shard, replicated = self.gradient_axes
        return not shard and bool(replicated)

    @property
    def data_ranks(self) -> int:
        """Ranks that see different tokens of a step (dp x fsdp x cp): the data-parallel ranks of
        the gradients' mean, over which expert parallelism rides."""
        return self.dp * self.fsdp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Data-parallel ranks holding the same experts: dp x fsdp x cp / ep."""
        return self.data_ranks // max(self.ep, 1)

    @property
    def data_parallel(self) -> int:
        """Ranks that each see a different slice of the batch."""
        return self.dp * self.fsdp

    @property
    def mesh_shape(self) -> dict[MeshAxis, int]:
        return {axis: getattr(self, axis.value) for axis in MESH_ORDER}

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def schedule(self) -> PipelineSchedule:
        """The record of pp_schedule (plan.schedules); PlanError for a name no record has."""
        if self.pp_schedule not in SCHEDULES:
            raise PlanError([unknown_schedule(self.pp_schedule)])
        return SCHEDULES[self.pp_schedule]

    @property
    def _placed(self) -> PipelineSchedule:
        # A name no record has lays its stages out as 1F1B's (one per rank), so that a plan
        # plan.validate refuses still counts its stages and describes itself.
        return SCHEDULES.get(self.pp_schedule, SCHEDULES["1f1b"])

    @property
    def stages_per_rank(self) -> int:
        return self._placed.stages_per_rank(self.virtual_stages)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: pp, times the stages each pipeline rank holds."""
        return self.pp * self.stages_per_rank

    @property
    def zero_bubble(self) -> bool:
        """Whether the schedule splits backwards into input (B) and weight (W) halves."""
        return self.pp > 1 and self._placed.zero_bubble

    def stage_ids(self, pp_rank: int) -> list[int]:
        """Global stage indices held by pipeline rank `pp_rank`, in the order it builds them:
        looped r, r + pp, ...; a V schedule's r and 2 * pp - 1 - r."""
        return self._placed.stage_ids(self.pp, pp_rank, self.virtual_stages)

    def stage_owner(self, stage: int) -> int:
        """The pipeline rank holding global stage `stage` (stage_ids' inverse)."""
        return self._placed.stage_owner(self.pp, stage)

    def pipeline_ops(self, pp_rank: int) -> list[Op]:
        """(action, local stage, split) in the order pipeline rank `pp_rank` runs them in one step:
        'F', 'B' (under a zero-bubble schedule the input half of a backward) or 'W' (its weight
        half); the schedule's own order (plan.pipeline_order)."""
        return self.schedule.ops(self.pp, pp_rank, self.n_microbatches, self.virtual_stages)

    def layer_counts(self, num_layers: int) -> list[int]:
        """Decoder layers of each global stage: `stage_layers` when given, else split_layers."""
        total = self.n_stages if self.pp > 1 else 1
        if self.stage_layers and total > 1:
            return list(self.stage_layers)
        return split_layers(num_layers, total)

    def stage_layer_ids(self, num_layers: int, stage: int) -> list[int]:
        """The decoder layers (global indices) of global stage `stage`."""
        counts = self.layer_counts(num_layers)
        start = sum(counts[:stage])
        return list(range(start, start + counts[stage]))

    def layer_stage(self, num_layers: int, layer: int) -> int:
        """The global stage holding decoder layer `layer`."""
        end = 0
        for stage, n in enumerate(self.layer_counts(num_layers)):
            end += n
            if layer < end:
                return stage
        raise IndexError(f"layer {layer} is past the {num_layers} layers")

    def same_layout(self, other: "Plan") -> bool:
        """Whether `other` has every rank hold what this plan's ranks hold: they differ at most in
        TRAINING_FIELDS (how batches are cut, the step's knobs, the data's seed)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return all(mine[k] == theirs[k] for k in mine if k not in TRAINING_FIELDS)

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        parts = [f"{a.value}{getattr(self, a.value)}" for a in MESH_ORDER if getattr(self, a.value) > 1]
        if self.ep > 1:  # not a mesh axis of its own: it rides on the data-parallel ranks
            parts.append(f"ep{self.ep}")
        text = "x".join(parts) or "single"
        # Only the knobs that came after the first names, so the existing layouts keep theirs.
        if self.zero_bubble:
            text += f" {self.pp_schedule}"
        if self.cp > 1 and self.cp_method != "allgather":
            text += f" {self.cp_method}"
        if self.tp > 1 and self.loss_parallel:
            text += " loss-parallel"
        if self.tp > 1 and not self.vocab_parallel:
            text += " whole-vocab"
        if self.compile:
            text += " compiled"
        return text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> "Plan":
        """'dp=2,tp=2' (commas or spaces) -> Plan; for command lines."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = dict(defaults)
        for item in text.replace(",", " ").split():
            key, sep, raw = item.partition("=")
            if not sep or key not in fields:
                raise PlanError([f"cannot read {item!r}: expected name=value with a name among {', '.join(fields)}"])
            kind = type(getattr(cls(), key))
            try:
                if kind is tuple:  # stage_layers=7/8/8/7
                    values[key] = tuple(int(x) for x in raw.split("/") if x)
                else:
                    values[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
            except ValueError:
                raise PlanError([f"{key}={raw!r} is not a {kind.__name__}"]) from None
        return cls(**values)


def schedule_order(plan: Plan, pp_rank: int) -> list[tuple[str, int]]:
    """('F' | 'B' | 'W', local stage index) in the order this pipeline rank runs them in one step
    (Plan.pipeline_ops without the split flag): under a zero-bubble schedule 'B' is the input half
    of a backward and 'W' its weight half."""
    return [(a, local) for a, local, _ in plan.pipeline_ops(pp_rank)]


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Plan)


def field_choices(name: str) -> tuple | None:
    """The values Plan field `name` may take, read from its Literal type; None for a free field."""
    hint = _hints().get(name)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


@functools.cache
def field_docs(cls: type = Plan) -> dict[str, str]:
    """Field name -> the docstring under that field in the source of `cls` (a Plan or a dataclass
    derived from it; a field documented in several classes takes its latest docstring),
    whitespace folded to one line."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
