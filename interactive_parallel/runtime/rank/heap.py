"""Hand the heap's freed pages back to the operating system after a call (glibc's malloc_trim).

A step frees most of what it allocated (activations, gradients' buffers, a pipeline's microbatches),
but glibc keeps freed heap pages mapped for the next allocation: an engine that trained under one
plan still holds that plan's peak when it trains under the next, and a few ranks on a 2 GB machine
(Binder) add that up. Measured on a 2-rank pipeline (bench/bench_notebook_memory.py's notes in
docs/workshops.md): a rank's own memory after 6 steps of 1F1B falls from 293 MiB to 111 MiB with a
trim. Nothing of torch's is freed (its CPU tensors are malloc'd; the ones alive stay); the next
call pays at most the page faults of growing again. Knows nothing else; a no-op off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_libc: list = []


def release_freed() -> bool:
    """malloc_trim(0): every arena's free pages back to the OS. False where there is no glibc."""
    if not _libc:
        try:
            _libc.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _libc.append(None)
    trim = _libc[0]
    return bool(trim and trim(0))


M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (glibc's malloc.h)."""
MMAP_THRESHOLD_BYTES = 64 * 1024
"""Allocations from this size up get pages of their own, unmapped again when freed."""


def return_large_frees(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Give every allocation of `threshold` bytes or more its own pages, handed back the moment it is
    freed (mallopt M_MMAP_THRESHOLD; a fixed threshold also stops glibc raising it each time a large
    block is freed, which otherwise moves such blocks onto the heap). A step's activations and
    gradient buffers are then gone when freed rather than at the call's trim, so a rank's peak
    within a step is what is alive, not everything the step allocated: for ranks that share a
    small machine (Binder's 2 GB), at the cost of a page fault per page of each large tensor.
    False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
