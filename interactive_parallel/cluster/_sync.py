"""Blocking twins of coroutines, in a script and inside a running event loop (Jupyter).

Owns the event loops the blocking twins run on: one kept per calling thread when that
thread runs no loop (a script; asyncio.run would build and tear down a loop and its
executor thread on every call, a few ms each, measured), and one private loop thread
used when the caller's thread already runs a loop (a notebook kernel), where
run_until_complete is not allowed. Knows nothing else.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()
_local = threading.local()


def _private_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="interactive-parallel-sync", daemon=True).start()
        return _loop


def _thread_loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop


def run_sync(coro: Coroutine) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _thread_loop().run_until_complete(coro)
    return asyncio.run_coroutine_threadsafe(coro, _private_loop()).result()
