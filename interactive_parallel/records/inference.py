"""Records of inference: streamed tokens, decoding steps, serving requests and their results,
generations and quantization.

Knows nothing of torch, ipyparallel or plotly (records/base.py has the dict mechanism).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from .base import Record, table

ServeEngine = Literal["transformers", "ours"]
"""Who runs a serving call: transformers' ContinuousBatchingManager or this package's scheduler."""
ServePolicy = Literal["continuous", "static"]
"""When requests join: at any step while there is room, or only once the previous batch ended."""


@dataclass(frozen=True)
class GenerateOptions(Record):
    """How a generate call samples (the same on every rank)."""

    kind: ClassVar[str] = "generate_options"
    do_sample: bool = False
    """False: greedy."""
    temperature: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    seed: int = 0
    """Seeds the sampler; every rank draws the same."""


@dataclass(frozen=True)
class ServeOptions(Record):
    """How a serving call runs, as the client chose it (the same on every rank)."""

    kind: ClassVar[str] = "serve_options"
    engine: ServeEngine | Literal["auto"]
    """The ranks always get a chosen engine; 'auto' is the client's request before it chooses."""
    reason: str = ""
    """Why that engine (plan/inference.serving_engine)."""
    policy: ServePolicy = "continuous"
    max_batch: int = 8
    """Most requests running at once on a replica."""
    kv_tokens: int | None = None
    """KV cache token slots per rank (None: no limit)."""


@dataclass
class TokenRecord(Record):
    """New text of one prompt after one decoding step (generation streams these)."""

    kind: ClassVar[str] = "token"
    rank: int
    prompt: int
    """Index of the prompt in the call."""
    position: int
    """Decoding step (0: the first new token)."""
    text: str
    """The text this step added (may be empty: a special token, or the prompt already ended)."""
    done: bool = False
    """True once the prompt's completion is finished (end-of-sequence or max_new_tokens)."""
    time: float = 0.0


@dataclass
class DecodeStep(Record):
    """One forward of a generation or serving loop on one rank: what it produced and what it cost."""

    kind: ClassVar[str] = "decode_step"
    rank: int
    step: int
    """0: the prompts' forward (prefill); then one per scheduler step (a token for each running row)."""
    phase: str
    """'prefill', 'decode', or 'mixed' (serving: joining requests' prompts beside the running tokens)."""
    start: float
    """Host time (time.time) at the start of the step."""
    time_s: float
    tokens: int
    """New tokens the step produced on this rank (one per live row)."""
    running: int
    """Rows in the running batch during the step."""
    waiting: int = 0
    """Requests that had arrived but were not admitted yet (serving)."""
    kv_bytes: int = 0
    """Bytes of this rank's KV cache after the step (its heads under TP, its layers under PP)."""
    kv_budget: int = 0
    """Bytes of KV cache the scheduler may fill on this rank (0: no limit)."""
    comm_s: float = 0.0
    """Time in communication, from the comm ledger (0 with the probes off or on one rank)."""
    comm_bytes: int = 0
    comm_ops: int = 0
    engine: str = ""
    """'generate', or the serving engine: 'ours' or 'transformers'."""

    @property
    def compute_s(self) -> float:
        return max(self.time_s - self.comm_s, 0.0)


@dataclass
class Request(Record):
    """One request to serve: a prompt arriving at a time, with its own limits and sampling."""

    kind: ClassVar[str] = "serve_request"
    id: str
    prompt: str
    arrival: float = 0.0
    """Seconds after the serving call starts."""
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    """Stop strings: the completion ends with the first one it produces (kept in the text)."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    """Seed of this request's own sampler: its samples do not depend on what it was batched with."""


@dataclass
class RequestRecord(Record):
    """What happened to one served request; times in seconds after the serving call started."""

    kind: ClassVar[str] = "request"
    id: str
    rank: int
    """The rank that reported it (the leader of the replica that served it)."""
    prompt: str
    arrival: float
    admitted: float = -1.0
    """When its prompt entered the running batch (-1: never)."""
    first_token: float = -1.0
    finished: float = -1.0
    tokens: int = 0
    text: str = ""
    finish_reason: str = ""
    """'eos', 'length', 'stop' (a stop string), 'interrupted' or 'error: ...'."""
    engine: str = ""

    @property
    def ttft(self) -> float:
        """Time to first token, from arrival."""
        return self.first_token - self.arrival if self.first_token >= 0 else float("nan")

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        if self.tokens < 2 or self.finished < 0:
            return float("nan")
        return (self.finished - self.first_token) / (self.tokens - 1)


@dataclass
class ServeResult(Record):
    """A serving call: every request's record and every rank's steps."""

    kind: ClassVar[str] = "serve"
    engine: str
    """'ours' (this package's scheduler over transformers' caches) or 'transformers' (its engine)."""
    reason: str
    """Why that engine ran."""
    policy: str
    """'continuous' or 'static'."""
    plan: str
    wall_s: float
    """Seconds from the serving loop's start until its last request finished (the busiest replica;
    the engine's setup and teardown are not in it)."""
    requests: list[RequestRecord] = field(default_factory=list)
    steps: list[DecodeStep] = field(default_factory=list)

    @property
    def texts(self) -> dict[str, str]:
        return {r.id: r.text for r in self.requests}

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_ttft(self) -> float:
        done = [r.ttft for r in self.requests if r.first_token >= 0]
        return sum(done) / len(done) if done else float("nan")

    @property
    def n_steps(self) -> int:
        """Scheduler steps of the busiest rank."""
        per_rank: dict[int, int] = {}
        for s in self.steps:
            per_rank[s.rank] = per_rank.get(s.rank, 0) + 1
        return max(per_rank.values(), default=0)

    def __str__(self) -> str:
        head = (f"serve ({self.engine}, {self.policy}, plan {self.plan}): {len(self.requests)} requests, "
                f"{self.tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.0f} tokens/s), "
                f"{self.n_steps} steps, mean time to first token {self.mean_ttft:.3f} s")
        shown = [dataclasses.replace(r, text=repr(r.text)) for r in self.requests]  # newlines stay on one row
        return head + "\n" + table(shown, ("id", "arrival", "admitted", "first_token", "finished", "tokens",
                                            "finish_reason", "text"))

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


@dataclass
class Generation(Record):
    """One rank's part of a generate call: its prompts' completions and its decoding steps."""

    kind: ClassVar[str] = "generation"
    rank: int
    texts: dict[int, str]
    """Prompt index -> completion, for the prompts this rank's replica decoded."""
    steps: list[DecodeStep] = field(default_factory=list)
    """The steps no channel took (all of them when no driver listens)."""


@dataclass
class QuantizeRecord(Record):
    """One rank's model before and after quantization (every number measured on the rank)."""

    kind: ClassVar[str] = "quantize"
    rank: int
    scheme: str
    plan: str
    linears: int
    """Linear layers quantized on this rank."""
    params_before: int
    """Bytes of the parameters the forward uses, before."""
    params_after: int
    kept_bytes: int = 0
    """Full-precision weights kept aside, so apply / load / dequantize return to them exactly."""
    tokens_per_s_before: float = 0.0
    tokens_per_s_after: float = 0.0
    agreement: float = 0.0
    """Fraction of the probe's greedy tokens equal to the unquantized model's."""
    probe: str = ""
    """What the speed and agreement were measured on."""
