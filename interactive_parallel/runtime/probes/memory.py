"""Memory of one rank: bytes of parameters, gradients, optimizer state, and the step's activations.

Owns the counting rules. Every tensor is counted by its *local* part (a DTensor by its
`_local_tensor`) and by unique storage: FSDP2 gradients are views into one reduce-scatter
buffer and its parameters views into padded shards, so per-tensor `nbytes` would be
wrong; a storage's full `nbytes` (padding included) is what the process holds.
- params: storages of the parameters this rank trains (`Parallelized.parameters()`).
  Under PP a rank still keeps the rest of the transformers model it was built from;
  those layers are not trained here and are not counted.
- grads: storages of those parameters' `.grad`, read just before `optimizer.step()`.
- optimizer: storages of every tensor in the optimizer's state, read after the step.
- activations: on CUDA, the peak allocated during the step minus what was allocated at
  its start. On CPU, the peak over the step of live bytes saved for backward, from a
  `saved_tensors_hooks` pair: a saved tensor counts from pack until autograd frees it;
  parameters (and views of them, FSDP's gathered weights included) are not counted.
- rss: process resident set size at the end of the step, for orientation.

Does not know: temporaries that are never saved for backward (CPU), what activation
recomputation keeps inside its layers (CPU: torch's checkpoint holds those through
saved-tensor hooks of its own; tests/test_recompute.py measures them with torch's
MemTracker), allocator caching, or DDP's flat bucket buffers (communication scratch,
not gradients).
"""
from __future__ import annotations

import os
import threading
from typing import Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # torch imports it itself: no cost


def local(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_id(t: torch.Tensor) -> int:
    """Identity of the storage under `t`: its data pointer, except for the fake tensors of a dry
    run (runtime.dryrun), whose pointers are all 0: there the storage object itself, which views
    share as they share data."""
    s = t.untyped_storage()
    return s._cdata if is_fake(t) else s.data_ptr()


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage_id, bytes) of the storage under `t`'s local part; None when it has none
    (meta tensors hold nothing: a pipeline stage runs on them while it infers shapes)."""
    t = local(t)
    if t.is_meta:
        return None
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    return (storage_id(t), nbytes) if nbytes else None


def unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            k = _key(t)
            if k is not None:
                seen.add(k)
    return sum(n for _, n in seen)


def param_bytes(params: list[nn.Parameter]) -> int:
    return unique_bytes(params)


def grad_bytes(params: list[nn.Parameter]) -> int:
    return unique_bytes(p.grad for p in params)


def optimizer_bytes(optimizer) -> int:
    return unique_bytes(v for state in optimizer.state.values() for v in state.values())


_PROC: list = []


def rss() -> int:
    try:
        if not _PROC or _PROC[0].pid != os.getpid():
            import psutil

            _PROC[:] = [psutil.Process(os.getpid())]
        return int(_PROC[0].memory_info().rss)
    except Exception:  # noqa: BLE001 - orientation only
        return 0


class _Saved:
    """What autograd holds instead of a saved tensor; its death is when the bytes are freed."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker.release(self.key)


class SavedTensors:
    """Peak live bytes saved for backward while the context is open."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {k for k in (_key(t) for t in exclude) if k is not None}
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0
        self.lock = threading.Lock()
        self._ctx = None

    def release(self, key) -> None:
        with self.lock:
            n = self.refs.get(key, 0) - 1
            if n <= 0:
                self.refs.pop(key, None)
                self.live -= key[1]
            else:
                self.refs[key] = n

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter):
            return t
        key = _key(t)
        if key is None or key in self.exclude:
            return t
        with self.lock:
            n = self.refs.get(key, 0)
            self.refs[key] = n + 1
            if n == 0:
                self.live += key[1]
                self.peak = max(self.peak, self.live)
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def __enter__(self) -> "SavedTensors":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class DevicePeak:
    """CUDA: bytes the step allocated beyond what was live at its start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def __enter__(self) -> "DevicePeak":
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def peak(self) -> int:
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
