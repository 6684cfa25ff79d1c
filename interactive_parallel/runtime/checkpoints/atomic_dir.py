"""Directories that appear whole or not at all: written under a temporary name, moved into place.

Owns the naming of a directory being written (`<name>.partial-<token>` beside its final
name, so an interrupted write is plain to see and never mistaken for the real thing), the
move into place once it is complete (replacing what was there in one step where the
file system allows: Linux's renameat2 RENAME_EXCHANGE swaps the two directories, so at
every instant the final name holds either the previous directory or the new one), and
finding the partial ones an interruption left. Checkpoints (cluster/model_ops.py save)
and recovery snapshots (runtime/checkpoints/checkpoint.py) are written this way. Plain `os` only:
the client imports it without torch. Knows nothing of what the directories hold.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import uuid

PARTIAL = ".partial-"
_PARTIAL_RE = re.compile(r"\.partial-[0-9a-z]+$")
_RENAME_EXCHANGE = 2


def staging_path(path: str, token: str | None = None) -> str:
    """Where `path` is written before it is complete (`token`: the same name on every rank)."""
    path = os.path.abspath(path).rstrip(os.sep)
    return f"{path}{PARTIAL}{token or uuid.uuid4().hex[:12]}"


def is_partial(path: str) -> bool:
    """A directory still being written, or left half-written by an interruption."""
    return bool(_PARTIAL_RE.search(os.path.abspath(path).rstrip(os.sep)))


def partials(path: str) -> list[str]:
    """Partial writes of `path` lying beside it (an interrupted save leaves one)."""
    path = os.path.abspath(path).rstrip(os.sep)
    parent, name = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(os.path.join(parent, n) for n in names if n.startswith(name + PARTIAL) and is_partial(n))


def publish(staging: str, path: str) -> None:
    """Move the complete directory `staging` to `path`; a directory already at `path` is
    replaced in one step (swapped, then removed) where the file system can swap."""
    path = os.path.abspath(path).rstrip(os.sep)
    if not os.path.lexists(path):
        os.rename(staging, path)
        return
    if not _exchange(staging, path):
        # No atomic swap here (not Linux, or a file system without it): a short window in
        # which `path` is missing and the previous directory waits under staging + '.old'.
        old = staging + ".old"
        os.rename(path, old)
        os.rename(staging, path)
        staging = old
    shutil.rmtree(staging, ignore_errors=True)  # it now holds the previous directory


def _exchange(a: str, b: str) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return renameat2(at_fdcwd, a.encode(), at_fdcwd, b.encode(), _RENAME_EXCHANGE) == 0


def remove_partials(path: str) -> list[str]:
    """Delete the partial writes an earlier interrupted save of `path` left; the ones removed."""
    found = partials(path)
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found
