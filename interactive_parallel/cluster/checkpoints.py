"""The user's checkpoints, as the client sees them: the manifest beside DCP's files, the refusals
before a save replaces a directory or a load reads another model, and the atomic directory a
save is written under.

Owns `MANIFEST` (model spec, plan, tensors, optimizer, step, kind: JSON, written last, so a
directory with it is whole; a transformers directory from save_pretrained carries one too, so
either save may replace the other), the rule that a save replaces only a checkpoint, and the
checks a load makes on this side before any rank reads (an interrupted save, no manifest, a
checkpoint of another model, naming its parameters). A save is written under a temporary
name beside its path and moved into place (runtime/checkpoints/atomic_dir.py); the tensors themselves are
torch.distributed.checkpoint's, written and read by the ranks (runtime/checkpoints/checkpoint.py). Knows
nothing of pools or torch: the rank call is handed in.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Awaitable, Callable

from ..plan import ModelSpec, Plan
from ..records import SaveInfo
from ..runtime.checkpoints import atomic_dir
from .errors import SessionError

MANIFEST = "interactive_parallel.json"
TRANSFORMERS = "transformers"
"""The manifest's `kind` of a directory written for transformers (Session.save_pretrained),
which save may replace and load refuses: load_model reads it."""


class CheckpointError(SessionError):
    """A checkpoint that does not fit the loaded model; `problems` names the parameters."""

    def __init__(self, message: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{message}:\n  - " + "\n  - ".join(self.problems))


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


async def save(path: str, spec: ModelSpec, plan: Plan, write: Callable[[str], Awaitable[SaveInfo]],
               kind: str = "checkpoint") -> str:
    """Refuse a `path` that is not a checkpoint first (before `write` touches any rank); then
    `write(staging)` has the ranks write their shards there, the manifest follows, and the
    directory moves into place. An interrupted save leaves the previous checkpoint at `path`
    whole and its own files under `<path>.partial-<token>` (removed by the next save of `path`).
    `kind`: what the manifest says the directory is (TRANSFORMERS: a save_pretrained)."""
    path = os.path.abspath(path)  # the ranks' working directory is not ours
    refuse_replacing(path)
    atomic_dir.remove_partials(path)
    staging = atomic_dir.staging_path(path)
    os.makedirs(staging)
    try:
        info = await write(staging)
        manifest = {"model": dataclasses.asdict(spec), "plan": plan.to_dict(),
                    "tensors": info.tensors, "optimizer": info.optimizer, "step": info.step, "kind": kind}
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        atomic_dir.publish(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def check_loadable(path: str, spec: ModelSpec) -> str:
    """The absolute path of a whole checkpoint of `spec`'s model, or the error that says why not
    (before any rank reads it; the ranks then check its shapes against their layout)."""
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
        manifest = json.load(f)
    if manifest.get("kind") == TRANSFORMERS:
        raise FileNotFoundError(f"{path} is a transformers directory (save_pretrained), not a checkpoint: "
                                f"load_model({path!r}) reads its weights")
    saved = manifest["model"]
    if saved.get("config") != spec.config:
        from ..plan.estimate import param_inventory, parameter_mismatches

        theirs = {p.name: p.shape for p in param_inventory(ModelSpec(**saved))}
        ours = {p.name: p.shape for p in param_inventory(spec)}
        raise CheckpointError(f"checkpoint {path} is of model {saved.get('name')!r}, not the loaded "
                              f"{spec.name!r} (load_model the same model first)",
                              parameter_mismatches(ours, theirs) or ["same parameters, another config"])
    return path


def shard_bytes(max_shard_size: int | str) -> int:
    """Bytes of `max_shard_size` ('5GB', '500MB' or an int), parsed as transformers' save_pretrained
    parses it (huggingface_hub's parser: decimal units), or ValueError before any rank is touched."""
    if isinstance(max_shard_size, str):
        from huggingface_hub.serialization._base import parse_size_to_int

        max_shard_size = parse_size_to_int(max_shard_size)
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size({max_shard_size!r}) must be a positive number of bytes or a size "
                         "such as '5GB'")
    return max_shard_size
