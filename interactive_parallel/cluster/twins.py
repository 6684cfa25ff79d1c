"""Blocking twins of coroutines: written once as `name_async`, made one way into `name`.

Owns the one mechanism (as ipyparallel's AsyncFirst does, with our naming the other way
round: the plain name blocks, because workshops type the plain names) and the event loops
the twins run on: one kept per calling thread when that thread runs no loop (a script;
asyncio.run would build and tear down a loop and its executor on every call, a cost
every small call would pay), and one private loop thread used when the caller's thread already runs a
loop (a notebook kernel), where run_until_complete is not allowed. Knows nothing else.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
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
    """The coroutine's result, from code that is not itself a coroutine."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _thread_loop().run_until_complete(coro)
    return asyncio.run_coroutine_threadsafe(coro, _private_loop()).result()


def _twin(name: str, coro_fn):
    @functools.wraps(coro_fn)
    def blocking(self, *args: Any, **kwargs: Any) -> Any:
        return run_sync(coro_fn(self, *args, **kwargs))

    blocking.__name__ = blocking.__qualname__ = name
    blocking.__signature__ = inspect.signature(coro_fn)  # type: ignore[attr-defined]
    blocking.__doc__ = coro_fn.__doc__
    blocking.__wrapped_async__ = coro_fn  # type: ignore[attr-defined]
    return blocking


def blocking_twins(cls: type) -> type:
    """Class decorator: for every `async def name_async`, add a blocking `name` with the same
    signature and docstring. A class that also writes `name` by hand is refused: one body each."""
    for attr, fn in list(vars(cls).items()):
        if not (attr.endswith("_async") and inspect.iscoroutinefunction(fn)):
            continue
        name = attr[: -len("_async")]
        if name in vars(cls):
            raise TypeError(f"{cls.__name__}.{name} is written by hand beside {attr}: write the coroutine only")
        setattr(cls, name, _twin(name, fn))
    return cls
