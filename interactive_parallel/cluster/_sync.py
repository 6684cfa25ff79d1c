"""Blocking twins of coroutines, in a script and inside a running event loop (Jupyter).

Owns the one private event-loop thread used when the caller's thread already runs a
loop (a notebook kernel), where asyncio.run is not allowed. Knows nothing else.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _private_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="interactive-parallel-sync", daemon=True).start()
        return _loop


def run_sync(coro: Coroutine) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    return asyncio.run_coroutine_threadsafe(coro, _private_loop()).result()
