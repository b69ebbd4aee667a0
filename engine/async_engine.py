"""An engine on its own thread, driven from asyncio.

Queues: coroutines post commands (add a request, abort, any call on the engine) → the engine
thread runs them between steps → after each step it hands the whole list of outputs to
``on_outputs``, once, on the engine thread (a serving role packs them into one message there);
without a hook, outputs resolve the waiters of :meth:`AsyncEngine.run`. If the thread dies,
every waiter fails and ``on_error`` is told. Only the engine thread touches the engine: after
each step (and each turn that ran commands) it publishes a snapshot in ``feed``
(:mod:`engine.snapshot`), which is all that other threads read of it; ``info`` holds what the
engine runs (fixed at start).
Tickers (for example a KV endpoint's ``poll``) run on the engine thread once per loop turn and
return whether they have work in flight: an idle engine then polls every ``BUSY_POLL_S``, and
otherwise sleeps until a command wakes it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDeadError, RequestIdInUse
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.snapshot import StatsFeed

log = logging.getLogger(__name__)
BUSY_POLL_S = 0.0005  # idle engine, a ticker's work in flight (a KV transfer)
IDLE_WAIT_S = 0.05  # idle engine, nothing in flight: commands wake it at once anyway
# An engine thread that has not come round its loop for this long is wedged (a step or command
# that never returns: a hung device, a deadlock): the health check fails, so Serve replaces it.
# Far above any step's time (seconds for a long prompt on the largest model).
WEDGED_S = 60.0

OutputsHook = Callable[[list[RequestOutput]], None]
FinishedHook = Callable[[LLMEngine, RequestOutput], None]


class AsyncEngine:
    def __init__(self, config: EngineConfig, on_outputs: OutputsHook | None = None,
                 on_error: Callable[[BaseException], None] | None = None):
        self.engine = LLMEngine(config)
        self.info = engine_info(self.engine)
        self.inputs = self.engine.processor  # its grammar compiler is thread-safe (cached)
        self.feed = StatsFeed(self.engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._on_outputs = on_outputs or self.resolve_waiters
        self._on_error = on_error
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future,
                                       FinishedHook | None]] = {}
        self._tickers: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.turned_at = time.monotonic()  # the engine thread's last turn of its loop
        self._thread = threading.Thread(target=self._run, daemon=True, name="baton-engine")
        self._thread.start()
        freeze_startup_heap()

    # -- commands ---------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread; a future of its result."""
        if self.error is not None:
            raise EngineDeadError(f"engine thread died: {self.error!r}")
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        if self.error is not None:  # died meanwhile: no thread will take it
            self._fail_commands()
        return fut

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    def abort(self, request_id: str) -> None:
        """Abort a request from the event loop without waiting (safe once the engine died)."""
        if self.error is None:
            self.submit(lambda e: e.abort_request(request_id))

    def add_ticker(self, fn: Callable[[], bool | None]) -> None:
        """Run ``fn`` on the engine thread every loop turn; it returns True while it has work in
        flight that needs polling."""
        self._tickers.append(fn)

    # -- whole requests (without an outputs hook) -------------------------------------------
    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured output on a worker thread, so the engine thread,
        which compiles it again when the request is added, finds it in its cache instead of
        stalling every running request for the compile (xgrammar releases the GIL)."""
        if params.structured_output is not None:
            await asyncio.to_thread(self.inputs.compile_grammar, params.structured_output)

    async def run(self, prompt: Prompt, params: SamplingParams, request_id: str,
                  hold_blocks: bool = False, then: FinishedHook | None = None,
                  added: Callable[[], None] | None = None) -> RequestOutput:
        """Run a request to its end and return its last output; a caller that goes away
        aborts it. ``then(engine, output)`` runs on the engine thread as the step that finished
        the request returns, before the next step (a prefill replica can start its push there
        rather than a loop turn later); what it raises, the caller gets. ``added()`` runs on
        the engine thread once it has taken the request.

        The event loop is woken only by the request's end (or the add's failure), not by the
        add itself: a wake-up there would run this coroutine's Python on the loop while the
        engine thread launches the request's first step, both under the process's one GIL."""
        if request_id in self._waiters:  # refused before anything is touched: that id's run
            raise RequestIdInUse(f"request_id: {request_id!r} is already in use")  # goes on
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._waiters[request_id] = (loop, done, then)

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(prompt, params, request_id, hold_blocks)
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                loop.call_soon_threadsafe(_set_exception, done, exc)
                return
            if added is not None:
                added()

        try:
            await self.compile_grammar(params)
            self.submit(add)
            return await done
        except RequestIdInUse:  # the engine holds the id for another request: left alone
            raise
        except BaseException:
            # Always: a cancel also cancels ``done``, so "done" cannot tell whether the request
            # ended; aborting a finished request is a no-op.
            self.abort(request_id)
            raise
        finally:
            self._waiters.pop(request_id, None)

    def resolve_waiters(self, outputs: list[RequestOutput]) -> None:
        """The default outputs hook: :meth:`run`'s callers get their requests' last outputs (a
        role that also streams requests calls it from its own hook)."""
        for out in outputs:
            if out.finished and (entry := self._waiters.get(out.request_id)) is not None:
                loop, fut, then = entry
                try:
                    if then is not None:
                        then(self.engine, out)
                except Exception as exc:  # noqa: BLE001 - the caller gets it
                    loop.call_soon_threadsafe(_set_exception, fut, exc)
                    continue
                loop.call_soon_threadsafe(set_result_once, fut, out)

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.engine.device.type == "cuda":  # the current device is per thread: this
                import torch  # one's work (events, plans) goes to the engine's device

                torch.cuda.set_device(self.engine.device)
            was_busy = False
            while not self._stop.is_set():
                self.turned_at = time.monotonic()
                ran = self._drain()
                busy = False
                for tick in self._tickers:
                    busy |= bool(tick())
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self.feed.publish(self.engine)
                    if outputs:
                        self._on_outputs(outputs)
                else:
                    # Commands and tickers change the engine too (a finished transfer gives
                    # its blocks back): published after any turn that ran them.
                    if ran or busy or was_busy:
                        self.feed.publish(self.engine)
                    self._wake.wait(BUSY_POLL_S if busy else IDLE_WAIT_S)
                    self._wake.clear()
                was_busy = busy
        except BaseException as exc:  # noqa: BLE001 - fail every waiter, loudly
            log.exception("engine thread died")
            self.error = exc
            if self._on_error is not None:  # told before any waiter learns of it
                self._on_error(EngineDeadError(repr(exc)))
            for loop, fut, _ in list(self._waiters.values()):
                loop.call_soon_threadsafe(_set_exception, fut, EngineDeadError(repr(exc)))
            self._fail_commands()

    def _fail_commands(self) -> None:
        """Fail the commands no thread will run (the engine thread died or stopped)."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(
                    f"engine thread died: {self.error!r}" if self.error is not None
                    else "engine shut down"))

    def _drain(self) -> bool:
        """Run the commands posted so far; whether there were any."""
        ran = False
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                fut.set_exception(exc)

    def kill_ranks(self) -> None:
        """Kill the other ranks of a split engine at once (any thread: only their processes
        are touched; the replica is about to exit)."""
        self.engine.kill_ranks()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`shutdown` has begun (its ranks then end on purpose)."""
        return self._stop.is_set()

    def check(self) -> None:
        """Raise if the engine cannot serve: its thread died or is wedged (``WEDGED_S``), or a
        rank of a split model died (a Serve health check: the replica is then replaced and its
        streams move)."""
        if self.error is not None:
            raise RuntimeError(f"engine thread died: {self.error!r}")
        stuck = time.monotonic() - self.turned_at
        if stuck > WEDGED_S and not self._stop.is_set():
            raise RuntimeError(f"engine thread wedged: no turn of its loop for {stuck:.0f} s")
        self.engine.check_ranks()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # commands posted after its last turn: failed, not lost
            self._fail_commands()
        self.engine.shutdown()


def engine_info(engine: LLMEngine) -> dict[str, str]:
    """The model, compute dtype, weights (``fp8 (...)`` or the dtype) and KV cache dtype."""
    return {"model": engine.source.model_id, "dtype": str(engine.dtype).removeprefix("torch."),
            "weights": engine.weights_name,
            "kv_cache_dtype": str(engine.runner.kv_dtype).removeprefix("torch.")}


def freeze_startup_heap() -> None:
    """Move every object alive now (the model, Ray, Serve, FastAPI: the whole start-up heap) out
    of the garbage collector's reach, as vLLM's engine does after start-up. A full collection
    otherwise walks that heap from inside whichever engine step triggers it; a prefill step
    allocates enough to trigger collections. ``BATON_GC_FREEZE=0`` turns it off (to measure)."""
    if os.environ.get("BATON_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()


def set_result_once(fut: asyncio.Future, value) -> None:
    """``fut``'s result, unless it is done already (its waiter went away and cancelled it); on
    the future's loop, as ``loop.call_soon_threadsafe(set_result_once, fut, value)``."""
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
