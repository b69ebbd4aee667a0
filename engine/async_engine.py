"""An engine on its own thread, driven from asyncio.

Queues: coroutines post commands (add a request, abort, any call on the engine) → the engine
thread runs them between steps → each step's outputs go to the asyncio queue of their request,
on the event loop that asked. Only the engine thread touches the engine. Tickers (for example a
KV endpoint's ``poll``) run on the engine thread once per loop turn.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.002


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._tickers: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="baton-engine")
        self._thread.start()

    # -- commands ---------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread; a future of its result."""
        if self.error is not None:
            raise EngineDeadError(f"engine thread died: {self.error!r}")
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    def add_ticker(self, fn: Callable[[], None]) -> None:
        self._tickers.append(fn)

    # -- streams ----------------------------------------------------------------------------
    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Register a queue for ``request_id``'s outputs (call from the event loop)."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def publish(self, out: RequestOutput) -> None:
        """Hand an output to its stream (engine thread)."""
        entry = self._streams.get(out.request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    async def stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it if the consumer leaves."""
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self.close_stream(request_id)
            if not finished and self.error is None:
                self.submit(lambda e: e.abort_request(request_id))

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       hold_blocks: bool = False) -> AsyncIterator[RequestOutput]:
        q = self.open_stream(request_id)
        try:
            await self.call(lambda e: e.add_request(prompt, params, request_id, hold_blocks))
        except BaseException:
            self.close_stream(request_id)
            raise
        async for out in self.stream(request_id, q):
            yield out

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                for tick in self._tickers:
                    tick()
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self.publish(out)
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - fail every waiter, loudly
            log.exception("engine thread died")
            self.error = exc
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(repr(exc)))

    def _drain(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                fut.set_exception(exc)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
