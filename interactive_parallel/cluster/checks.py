"""The client's refusals of bad input, before any rank is touched.

Owns every check that needs only the input and what the client already knows (the session's
device and size, the loaded model's spec, the applied plan, the quantization scheme): a plan
for this session, debug mode under DDP, prompts, serving requests, a fault to inject, the
whole numbers of a training call, the text a training call reads (reading the files with
plain Python, no tokenizer) and whether the tokens it makes fill one batch. Each returns
the checked value or raises one exception listing every problem with its numbers; pure, so
each is tested on inputs alone (tests/test_checks.py, tests/test_own_data.py). Knows nothing
of ranks, pools or torch; memory admission, which asks the ranks what is free, lives with
the model operations (cluster/model_ops.py), and so does asking rank 0 how many tokens a
text makes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Sequence

from ..plan import ModelSpec, Plan, PlanError, check
from ..plan.inference import quantization_problems, request_problems
from ..plan.plan import DEVICES
from ..records import DataSource, FaultSpec, Request
from .errors import SessionError
from .pool import LAUNCHES


def whole(value: Any) -> bool:
    """A whole number >= 0 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_plan(plan: Plan, device: str, world_size: int, spec: ModelSpec | None) -> Plan:
    """The plan as a session of `world_size` ranks on `device` would run it, or PlanError."""
    problems = []
    if plan.device != device:
        problems.append(f"plan device {plan.device!r} != session device {device!r}")
    try:
        check(plan, world_size, spec)
    except PlanError as exc:
        problems = exc.problems + problems
    if problems:
        raise PlanError(problems)
    return plan


def check_debug_plan(plan: Plan | None, debugging: bool) -> None:
    """DDP segfaults the engines when its group is a DETAIL debug wrapper (torch 2.13 CPU:
    constructing DistributedDataParallel dies with SIGSEGV); refuse it here."""
    if plan is not None and debugging and plan.uses_ddp:
        raise SessionError(f"debug mode cannot run plan {plan.describe()}: DDP crashes under "
                           "TORCH_DISTRIBUTED_DEBUG=DETAIL on this torch; use Plan(fsdp=...) "
                           "(or dp combined with another axis) while debugging")


def check_counts(**counts: Any) -> None:
    """Each named count a whole number >= 0, or PlanError naming every one that is not."""
    problems = [f"{name}({value!r}) must be a whole number >= 0" for name, value in counts.items() if not whole(value)]
    if problems:
        raise PlanError(problems)


ARITHMETIC = "arithmetic"
"""`train(data=ARITHMETIC)`: back to the package's synthetic task (the default)."""
TEXT_SUFFIXES = ("", ".txt", ".text", ".md")
"""A file with one of these suffixes is one plain text (UTF-8); `.jsonl` has a `text` per line."""


class DataError(ValueError):
    """The text given to train cannot be read as training data; the message says why."""


def check_data(data: Any) -> DataSource | None:
    """The DataSource a train call reads for `data` (a path; ARITHMETIC: None, the synthetic
    task), or DataError: missing, of an unknown kind, empty, a .jsonl line without a `text`
    string, a datasets directory without datasets installed. Reads the file, not the ranks."""
    if isinstance(data, str) and data == ARITHMETIC:
        return None
    if not isinstance(data, (str, os.PathLike)) or not str(data).strip():
        raise DataError(f"data {data!r} must be a path to a text file, a .jsonl file or a datasets directory "
                        f"(or {ARITHMETIC!r})")
    path = Path(data).expanduser().resolve()
    if not path.exists():
        raise DataError(f"data {str(data)!r}: no such file or directory ({path})")
    if path.is_dir():
        return _dataset_source(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        _check_jsonl(path)
        return DataSource(path=str(path), format="jsonl")
    if suffix not in TEXT_SUFFIXES:
        raise DataError(f"data {str(path)!r}: unknown kind {suffix!r}: give a text file ("
                        + ", ".join(repr(s) for s in TEXT_SUFFIXES if s) + " or no suffix), a .jsonl file with "
                        "a 'text' field per line, or a directory written by datasets' save_to_disk")
    _check_text(path)
    return DataSource(path=str(path), format="text")


def _check_text(path: Path) -> None:
    """Some text that is not blank, read up to its first (a large file is not read whole here)."""
    try:
        with path.open(encoding="utf-8") as f:
            while chunk := f.read(1 << 20):
                if chunk.strip():
                    return
    except UnicodeDecodeError as exc:
        raise DataError(f"data {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start} of a block)") from None
    raise DataError(f"data {str(path)!r} is empty" + (" (only blanks)" if path.stat().st_size else ""))


def _check_jsonl(path: Path) -> None:
    bad: list[str] = []
    texts = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                bad.append(f"line {n} is not JSON ({exc.msg})")
                continue
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
                bad.append(f"line {n} has no 'text' string (it holds {keys or 'nothing'})")
            elif text.strip():
                texts += 1
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise DataError(f"data {str(path)!r}: every line needs a 'text' string: " + "; ".join(bad[:3]) + more)
    if not texts:
        raise DataError(f"data {str(path)!r} is empty: no line holds any text")


def _dataset_source(path: Path) -> DataSource:
    # save_to_disk writes these: state.json beside the arrow files (a Dataset), dataset_dict.json
    # above one directory per split (a DatasetDict).
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise DataError(f"data {str(path)!r}: unknown kind: a directory, but not one written by datasets' "
                        "save_to_disk (no state.json or dataset_dict.json)")
    if importlib.util.find_spec("datasets") is None:
        raise DataError(f"data {str(path)!r} was written by datasets' save_to_disk, and the datasets package "
                        "is not installed: pip install datasets, or give a text or .jsonl file")
    return DataSource(path=str(path), format="datasets")


def check_data_length(source: DataSource, tokens: int, batch_size: int, seq_len: int, model: str = "") -> None:
    """DataError unless `tokens` (the text under the model's tokenizer, as rank 0 counted it)
    fill one batch: batch_size rows of seq_len + 1 tokens."""
    need = batch_size * (seq_len + 1)
    if tokens < need:
        under = f" under {model}'s tokenizer" if model else ""
        raise DataError(f"data {source.path!r} is shorter than one batch: {tokens} tokens{under}, and "
                        f"batch_size({batch_size}) x (seq_len({seq_len}) + 1) = {need}")


def prompt_strings(prompts: Sequence[Any]) -> bool:
    """Every prompt is a non-empty string (what a tokenizer may be asked to count)."""
    return bool(prompts) and all(isinstance(p, str) and p for p in prompts)


def check_prompts(prompts: list, max_new_tokens: Any, temperature: float, top_k: int, spec: ModelSpec,
                  lengths: Sequence[int] | None = None) -> None:
    """`lengths`: each prompt's tokens under the model's tokenizer (None: the package's, one per character)."""
    problems = []
    if not prompts:
        problems.append("no prompts given")
    if any(not isinstance(p, str) or not p for p in prompts):
        problems.append("every prompt must be a non-empty string")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problems.append(f"max_new_tokens({max_new_tokens}) must be >= 1")
    elif prompts and all(isinstance(p, str) for p in prompts):
        longest = max(lengths) if lengths is not None else max(len(p) for p in prompts)
        if longest + max_new_tokens > spec.max_positions:
            problems.append(f"longest prompt({longest}) + max_new_tokens({max_new_tokens}) > "
                            f"{spec.name} max positions({spec.max_positions})")
    if temperature <= 0:
        problems.append(f"temperature({temperature}) must be > 0")
    if top_k < 0:
        problems.append(f"top_k({top_k}) must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))


def check_quantization(scheme: str, plan: Plan, spec: ModelSpec) -> None:
    problems = quantization_problems(plan, scheme, spec)
    if problems:
        raise ValueError("; ".join(problems))


def refuse_quantized(scheme: str | None, what: str) -> None:
    if scheme is not None:
        raise SessionError(f"the model is quantized ({scheme}): {what} needs full-precision "
                           "weights; call dequantize() (or apply a plan, or load a checkpoint) first")


def as_requests(requests: Any) -> list[Request]:
    """Request objects from Requests, dicts, or bare prompt strings (TypeError for anything else)."""
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
    return reqs


def check_requests(reqs: list[Request], spec: ModelSpec, max_batch: int, kv_tokens: int | None,
                   lengths: Sequence[int] | None = None) -> list[Request]:
    """`reqs` (as_requests), or ValueError listing every problem; `lengths` as for check_prompts."""
    problems = request_problems(reqs, spec, max_batch=max_batch, kv_tokens=kv_tokens, lengths=lengths)
    if problems:
        raise ValueError("bad requests:\n  - " + "\n  - ".join(problems))
    return reqs


def check_fault(fault: FaultSpec, world_size: int, kinds: Sequence[str], places: Sequence[str]) -> FaultSpec:
    """A fault that can be armed on a session of `world_size` ranks, or ValueError naming every problem."""
    problems = []
    if not whole(fault.rank) or not fault.rank < world_size:
        problems.append(f"rank({fault.rank!r}) is not one of 0..{world_size - 1}")
    if fault.fault not in kinds:
        problems.append(f"fault {fault.fault!r} is not one of {', '.join(kinds)}")
    if fault.where not in places:
        problems.append(f"where {fault.where!r} is not one of {', '.join(places)}")
    if not whole(fault.at_step):
        problems.append(f"at_step({fault.at_step!r}) must be a whole number >= 0")
    if not whole(fault.collective):
        problems.append(f"collective({fault.collective!r}) must be a whole number >= 0")
    if not isinstance(fault.seconds, (int, float)) or isinstance(fault.seconds, bool) or fault.seconds < 0:
        problems.append(f"seconds({fault.seconds!r}) must be a number >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    return fault


def check_session_args(ranks: Any, device: Any, interface: Any, snapshot_every: Any, launch: Any = None,
                       flight_recorder: Any = 0) -> None:
    """Session(...)'s own arguments, before any process starts."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks({ranks}) must be a whole number >= 1")
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not " + " or ".join(repr(d) for d in DEVICES))
    if interface is not None and (not isinstance(interface, str) or not interface.strip()):
        raise ValueError(f"interface {interface!r} must be a network interface name such as 'eth0'")
    if not whole(snapshot_every):
        raise ValueError(f"snapshot_every({snapshot_every}) must be a whole number >= 0")
    if not whole(flight_recorder):
        raise ValueError(f"flight_recorder({flight_recorder}) must be a whole number of collectives >= 0")
    if launch is not None and launch not in LAUNCHES:
        raise ValueError(f"launch {launch!r} is not " + ", ".join(repr(x) for x in LAUNCHES))
