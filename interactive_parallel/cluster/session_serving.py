"""The Session's serving surface: continuous batching, what it leaves behind, and quantization.

Owns the public calls of serving a model once it is laid out: `serve` (and `serve_stream`, the
same as an async iterator), the records of the latest decoding call (`decoding`, `served`), and
torchao quantization of the laid-out model with its way back (`quantize`, `dequantize`,
`quantized`). Each remote action is a coroutine `name_async` with its blocking twin made by
`blocking_twins`, as on the Session itself (`generate`, the one-call decoding every lesson
starts with, stays there). A mixin of Session: it reads the Session's model operations
(cluster/model_ops.py) and telemetry, annotated here and assigned by Session. Knows nothing of
how the ranks batch or quantize (runtime.inference), nor of torch.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Literal

from ..records import (DecodeStep, RecordList, RequestRecord, ServeEngine, ServeOptions, ServePolicy, ServeResult,
                       TokenRecord)
from .model_ops import ModelOps
from .telemetry import Telemetry
from .twins import blocking_twins


@blocking_twins
class SessionServing:
    """Serving and quantization, on the Session (see the module docstring)."""

    model: ModelOps
    telemetry: Telemetry

    async def serve_async(self, requests: Any, *, engine: ServeEngine | Literal["auto"] = "auto",
                          policy: ServePolicy = "continuous",
                          max_batch: int = 8, kv_tokens: int | None = None,
                          on_token: Callable[[TokenRecord], None] | None = None,
                          on_request: Callable[[RequestRecord], None] | None = None,
                          on_step: Callable[[DecodeStep], None] | None = None) -> ServeResult:
        """Serve `requests` (Request objects, dicts of their fields, or prompt strings) with
        continuous batching in one call to the ranks: each arrives at its `arrival` second, joins
        the running batch at the next step while fewer than `max_batch` run and the KV cache they
        will need fits in `kv_tokens` (token slots per rank; None: no limit), and leaves when it
        ends (end of sequence, max_new_tokens, a stop string). policy='static' forms a batch only
        when the previous one has finished. engine: 'transformers' (its ContinuousBatchingManager),
        'ours' (this package's scheduler over transformers' caches, under any plan) or 'auto'
        (transformers' where it runs, see ServeResult.reason). Data-parallel replicas share the
        requests out. Tokens, finished requests and steps reach the callbacks as they happen;
        the ServeResult holds every request's record and every rank's steps."""
        options = ServeOptions(engine=engine, policy=policy, max_batch=max_batch, kv_tokens=kv_tokens)
        return await self.model.serve(requests, options, on_token, on_request, on_step)

    async def serve_stream(self, requests: Any, **options: Any) -> AsyncIterator[TokenRecord | ServeResult]:
        """serve_async as an async iterator: each TokenRecord as the ranks produce it, then the
        ServeResult. `async for item in s.serve_stream(requests): ...`"""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.serve_async(
            requests, on_token=lambda rec: loop.call_soon_threadsafe(queue.put_nowait, rec), **options))
        task.add_done_callback(lambda _t: loop.call_soon_threadsafe(queue.put_nowait, None))
        while True:
            item = await queue.get()
            if item is None:
                break
            yield item
        while not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                yield item
        yield task.result()

    async def quantize_async(self, scheme: str = "int8-weight-only") -> RecordList:
        """Quantize the laid-out model's block linears with torchao ('int8-weight-only',
        'int8-dynamic', 'int4-weight-only'); per rank, measured: parameter bytes before and
        after, the full-precision bytes kept aside, greedy decoding tokens/s before and after
        and the share of greedy tokens unchanged. Refused (naming the plan) where the layout
        cannot hold it. Training, verify and save refuse a quantized model; apply and load
        return to full precision (keep_quantization=True quantizes again)."""
        return await self.model.quantize(scheme)

    async def dequantize_async(self) -> None:
        """Put the full-precision weights back (exactly those quantize kept)."""
        await self.model.dequantize()

    def decoding(self) -> RecordList:
        """Every rank's DecodeSteps of the latest generate or serve call (no remote call)."""
        return self.telemetry.decoding

    def served(self) -> ServeResult | None:
        """The latest serve call's result: its requests and steps (no remote call)."""
        return self.telemetry.served

    def quantized(self) -> RecordList:
        """Per rank, what the latest quantize measured (empty: the model runs in full precision)."""
        return self.telemetry.quantization
