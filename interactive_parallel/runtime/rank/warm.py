"""Warm-up of the heavy imports (torch, transformers) in a thread, as a rank process starts.

Owns the warm-up thread and the wait for it. transformers resolves its names lazily and
that resolution is not thread-safe: the first real use must wait until the warm-up is
done (runtime.groups.join.identify, the first call the client makes, waits). Knows nothing else.
"""
from __future__ import annotations

import threading

_done = threading.Event()
_started = False


def import_heavy() -> None:
    """What a rank's first model build would import: torch, transformers' auto classes and
    the modeling module of each family in plan.models.FAMILIES (1.6 s of that first build
    on their own)."""
    import importlib

    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from ...plan.models import FAMILIES

    for family in FAMILIES.values():
        model_type = family.model_types[0]
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: F401


def _warm() -> None:
    try:
        import_heavy()
    except Exception:  # noqa: BLE001 - a failed warm-up shows up again, with its error, on first use
        pass
    finally:
        _done.set()


def start() -> None:
    global _started
    _started = True
    threading.Thread(target=_warm, name="warm-imports", daemon=True).start()


def wait(timeout: float = 120.0) -> None:
    if _started:
        _done.wait(timeout)
