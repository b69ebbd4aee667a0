"""Requests as the ingress follows them: started on the decode deployment by a Serve call, their
tokens arriving on the ingress's token sink.

Per request: :meth:`DecodeClient.start` registers a :class:`RequestStream` with the sink and
calls ``generate`` on a decode replica (Serve picks it; the call carries the sink's address) →
the sink feeds each engine step's delta to the stream, which detokenizes it and checks stop
strings (text lives here, not in the engine) → the writer (SSE, gRPC, or a whole-body answer)
takes everything that arrived since its last turn as one :class:`Chunk`, so a busy writer sends
fewer, larger chunks instead of falling behind → the request's ``GenerateResult`` (usage,
transfer stats, timings, or a refusal: ``BadRequest``) arrives on the same channel behind its
last tokens: the answer has one path back, in order. The Serve call returns nothing; its
exception says the replica (or the server) failed. A stop string, a client that leaves or a
deadline cancels the call (Serve's cancel and a ``cancel`` on the token channel,
:func:`cancel_call`), which aborts the request on the decode replica and frees its blocks.

Migration: when the call fails because its decode replica (or its token channel, or its engine)
is gone, the request is submitted again, under a new internal id, with the prompt plus every
token the stream already has as its prompt and the rest of ``max_tokens`` and ``min_tokens``
(``num_resumed_tokens`` tells the engine those prompt tokens are output, for the penalties); its
tokens join the same stream, so the client sees one stream with nothing missing or repeated.
Greedy tokens are those of an uninterrupted run, and so are seeded ones (draws are keyed by seed
and position).
The resumed request is prefilled anew (a prefix-cache hit where the replica holds the blocks).

No decode replica: in a disaggregated app (``fallback``, the prefill deployment), a call lost
with its replica, or a call no replica has taken after ``DECODE_SILENT_S`` (Serve holds calls
while no replica of a deployment runs, without an error; asked again every ``DECODE_SILENT_S``
until one takes it), asks the decode deployment whether any replica answers
(``DECODE_PROBE_TIMEOUT_S``, one question at a time); if none does, the decode pool is down:
every request on it moves (as above, with the tokens it has), and every request after them goes,
to the prefill replicas whole (each holds a full engine: it prefills and decodes there,
``prefill_worker.server``); the decode pool is asked again every ``DECODE_PROBE_INTERVAL_S``,
and once a replica answers, new requests go to it again (those on the prefill replicas finish
there).
A token that ends a request comes in the same delta as its finish reason, so a stream that has
not finished always has tokens left to make.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from contracts.messages import GenerateRequest, GenerateResult, TokenDelta, serve_logger
from contracts.role import SharedAnswer, any_replica_answers, role_full
from contracts.token_channel import TokenChannelLost, TokenSink, early_router
from engine.sampling_params import SamplingParams
from engine.errors import BadRequest
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import append_tokens
from router.ingress.door import ARRIVED
from router.ingress.errors import AtCapacity, NotStarted, RequestTimeout, replica_lost

log = serve_logger(__name__)

MAX_MIGRATIONS = 32  # moves of one request; the deadline bounds them too
MIGRATION_BACKOFF_S = (0.05, 0.2, 0.5, 1.0)  # then 1 s: Serve learns of a death in about that
DECODE_SILENT_S = 1.0  # a decode call no replica has taken by then: is any replica alive?
DECODE_PROBE_TIMEOUT_S = 1.0  # a decode replica that has not answered by then: none alive
DECODE_PROBE_INTERVAL_S = 0.5  # while the decode pool is down: how often to ask again


def cancel_call(call, sink: TokenSink | None, call_id: str) -> None:
    """Cancel a decode call: Serve's cancel, and the same word on the token channel (Serve
    drops its cancel when it comes while the call is being handed to a replica: the call then
    ran to its end unread, as a stop string found in the first tokens an early start held)."""
    call.cancel()
    if sink is not None and call_id:
        sink.cancel(call_id)


@dataclass
class Chunk:
    """What the client gets next: the tokens (and their text) since the previous chunk.
    ``produced_at``: when the engine produced the oldest of them (``time.time()``)."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    produced_at: float = 0.0
    top_logprobs: list[list] | None = None  # per token: [[id, logprob], ...], best first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RouterTiming:
    """The ingress's own milestones for one request (``time.time()`` seconds)."""

    arrived: float = 0.0  # HTTP: its request reached the ingress's app (before the body's parse)
    received: float = 0.0  # parsed and checked: the request service has it
    submitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0


@dataclass
class RequestStream:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None = None
    on_token: Callable[[float | None, float], None] | None = None  # metrics: (gap, produced_at)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list] | None = None
    prompt_logprobs: list | None = None  # asked for: per prompt position, from the first delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: BaseException | None = None
    result: GenerateResult | None = None
    timing: RouterTiming = field(default_factory=RouterTiming)
    call: object = None  # the current Serve call's DeploymentResponse
    sink: object = None  # the TokenSink its tokens come to
    pool: object = None  # the deployment handle of the current call (decode, or the fallback)
    call_id: str = ""  # the current call's internal request id (another after each migration)
    prompt_token_ids: tuple[int, ...] = ()
    migrations: int = 0
    moved_at: list[float] = field(default_factory=list)  # time.time() of each migration
    deadline: float = float("inf")  # time.monotonic() by which it must have ended
    start_by: float = float("inf")  # time.monotonic() by which its first token must be here
    cancelled: bool = False
    accepted: bool = False  # a replica has taken the current call (it said so on the channel)
    own_serve_id: bool = False  # one of a batch: its Serve calls get their own request id
    call_done: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # its result came (or never will)
    _sent: int = 0
    _oldest_unsent: float = 0.0
    _last_produced: float = 0.0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.logprobs:
            self.top_logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- fed by the token sink (event loop) -------------------------------------------------
    def feed(self, delta: TokenDelta, produced_at: float) -> None:
        self.accepted = True  # a replica has it (its first delta may carry no token)
        if self.finished:
            return
        if delta.token_ids:
            if not self.timing.first_token:
                self.timing.first_token = time.time()
            if self._sent == len(self.token_ids):
                self._oldest_unsent = produced_at
            if self.on_token is not None:
                gap = produced_at - self._last_produced if self._last_produced else None
                self.on_token(gap, produced_at)
            self._last_produced = produced_at
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if append_tokens(self, self.detok, delta.token_ids, delta.logprobs, delta.top_logprobs):
            self._finish("stop", self.detok.stop_reason)
            self.cancel()  # the engine stops on ids only: end it there
            return
        if delta.finished:
            self._finish(delta.finish_reason, delta.stop_reason)
        self._wake.set()

    def _finish(self, reason: str, stop_reason) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.timing.finished = time.time()
        if self.detok is not None:
            self.detok.finish()
        self._wake.set()

    def end(self, record: dict) -> None:
        """The decode replica's result, behind the request's last tokens (or its refusal)."""
        self.result = GenerateResult.from_wire(record)
        if self.result.error is not None:  # refused by the decode replica: the client's 400
            self.fail(BadRequest(self.result.error))
        elif not self.finished:
            self.fail(ConnectionError(f"request {self.request_id} ended without its last "
                                      "tokens"))
        self.ended.set()

    def fail(self, exc: BaseException) -> None:
        if not self.finished and self.error is None:
            self.error = exc
            self._wake.set()

    def cancel(self) -> None:
        if self.call is not None and not self.call_done.is_set():
            self.cancelled = True
            cancel_call(self.call, self.sink, self.call_id)

    # -- read by one writer ------------------------------------------------------------------
    async def chunks(self, deadline: float) -> AsyncIterator[Chunk]:
        """Everything new since the last chunk, until the request ends; raises the call's error,
        :class:`NotStarted` at ``start_by`` without a first token, or :class:`RequestTimeout`
        at ``deadline`` (``time.monotonic()``)."""
        while True:
            while not (self.finished or self.error or self._sent < len(self.token_ids)):
                self._wake.clear()
                waiting = not self.token_ids
                until = min(deadline, self.start_by) if waiting else deadline
                try:
                    await asyncio.wait_for(self._wake.wait(), until - time.monotonic())
                except asyncio.TimeoutError:
                    if waiting and time.monotonic() >= self.start_by and \
                            self.start_by < deadline:
                        raise NotStarted(f"request {self.request_id} was not started within "
                                         "the queue-time bound") from None
                    if time.monotonic() < deadline:
                        continue
                    raise RequestTimeout(f"request {self.request_id} was not served in "
                                         "time") from None
            if self.error is not None and not self.finished:
                raise self.error
            chunk = self._take()
            yield chunk
            if chunk.finished:
                return

    def _take(self) -> Chunk:
        n = len(self.token_ids)
        chunk = Chunk(self.token_ids[self._sent:n],
                      self.detok.take() if self.detok is not None else "",
                      self.logprobs[self._sent:n] if self.logprobs is not None else None,
                      self.finish_reason, self._oldest_unsent,
                      self.top_logprobs[self._sent:n] if self.top_logprobs is not None else None)
        self._sent = n
        return chunk


class DecodeClient:
    """The ingress's side of the decode deployment: starts requests, follows their tokens."""

    def __init__(self, decode_handle, tokenizer, host: str = "127.0.0.1", fallback=None,
                 queue_timeout_s: float | None = None, retry_after_s: float = 1.0,
                 decode_max_ongoing: int | None = None, early_start: bool = False):
        """``fallback``: where whole requests go while no decode replica answers (the prefill
        deployment of a disaggregated app; None: nowhere, requests wait for a decode replica).
        ``queue_timeout_s``: a request no decode replica has taken by then is refused
        (:class:`AtCapacity`) while every live one holds ``decode_max_ongoing`` requests, unless
        it goes to the fallback (no decode replica alive). ``early_start``: requests may go
        to their replica over its token channel ahead of their calls (``router.early_start``)."""
        self.decode = decode_handle
        self.fallback = fallback
        self.queue_timeout_s, self.retry_after_s = queue_timeout_s, retry_after_s
        self.tokenizer = tokenizer
        self.sink = TokenSink(host, early_start)
        self.decode_down = False
        self._streams: dict[str, RequestStream] = {}  # by request id, until the writer closes
        # A silent or lost call's question, one at a time: is any decode replica alive?
        self._decode_alive = SharedAnswer(self._decode_answers, DECODE_PROBE_INTERVAL_S).get
        self._decode_full = SharedAnswer(lambda: role_full(
            decode_handle, decode_max_ongoing, DECODE_PROBE_TIMEOUT_S), DECODE_PROBE_INTERVAL_S).get
        self._probe: asyncio.Future | None = None  # while down: until one answers

    async def start(self, ids: list[int], params: SamplingParams, request_id: str,
                    on_token=None, received: float | None = None,
                    own_serve_id: bool = False) -> RequestStream:
        """``own_serve_id``: this call is one of several one client request makes at once (a
        batch of prompts): it gets a Serve request id of its own (see ``_submit``)."""
        await self.sink.start()
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, min_tokens=params.min_tokens) \
            if self.tokenizer else None
        stream = RequestStream(request_id, len(ids), params, detok, on_token)
        stream.own_serve_id = own_serve_id
        stream.prompt_token_ids = tuple(ids)
        stream.timing.arrived = ARRIVED.get()
        stream.timing.received = received or time.time()
        stream.timing.submitted = time.time()
        self._submit(stream)
        return stream

    def _submit(self, stream: RequestStream, own_id: bool = False) -> None:
        """Call a decode replica for what the stream still lacks (all of it the first time).
        ``own_id``: called from another request's task (see ``own_serve_id``)."""
        have = stream.token_ids
        rid = stream.request_id if not stream.migrations else \
            f"{stream.request_id}~{stream.migrations}"
        p = stream.params
        params = p if not have else p.model_copy(update={
            "max_tokens": p.max_tokens - len(have), "min_tokens": max(p.min_tokens - len(have), 0),
            "num_resumed_tokens": len(have),  # they count as output for the penalties
            "prompt_logprobs": None})  # the first call's first delta brought them
        stream.call_id, stream.accepted, stream.sink = rid, False, self.sink
        stream.call_done.clear()  # (the last call's: this one runs)
        self.sink.register(rid, stream.feed, stream.end,
                           lambda: asyncio.ensure_future(self._channel_lost(stream, rid)))
        req = GenerateRequest(stream.prompt_token_ids + tuple(have), params, rid,
                              self.sink.address)
        stream.pool = self.fallback if self.decode_down else self.decode
        if self.sink.early_start:  # the replica's engine starts while the call travels
            router = early_router(getattr(stream.pool, "deployment_name", None))
            if router is not None:
                router.start_early(req)
        if stream.own_serve_id or own_id:
            # Serve tags a handle call with the calling request's internal id; concurrent calls
            # under one id collide in its bookkeeping (measured: the second and third of a
            # batch never reached a replica). Each gets its own, in a copy of the context.
            stream.call = contextvars.copy_context().run(self._call_with_own_id, stream.pool,
                                                        req)
        else:
            stream.call = stream.pool.generate.remote(req)
        self._streams[stream.request_id] = stream
        asyncio.ensure_future(self._follow(stream, rid))
        if stream.pool is self.decode and self.fallback is not None:
            asyncio.get_running_loop().call_later(DECODE_SILENT_S, self._if_silent, stream, rid)
        if stream.pool is self.decode and self.queue_timeout_s is not None and not have:
            asyncio.get_running_loop().call_later(self.queue_timeout_s, self._if_queued,
                                                  stream, rid)

    def _if_queued(self, stream: RequestStream, rid: str) -> None:
        if stream.call_id == rid and not stream.token_ids and not stream.ended.is_set() \
                and not stream.cancelled and not stream.accepted:
            asyncio.ensure_future(self._refuse_queued(stream, rid))

    async def _refuse_queued(self, stream: RequestStream, rid: str) -> None:
        """The request is still in Serve's queue. If every live decode replica holds all it
        may, it is refused now; if one has room (it is starting), it is asked again after
        another ``queue_timeout_s``; in a disaggregated app with no decode replica alive,
        ``_check_decode`` moves it to the prefill replicas."""
        if self.fallback is not None:
            await self._check_decode()
        if stream.call_id != rid or stream.token_ids or stream.ended.is_set() \
                or stream.cancelled or stream.accepted:
            return  # moved, taken by a replica meanwhile, or over
        if not await self._decode_full():
            asyncio.get_running_loop().call_later(self.queue_timeout_s, self._if_queued,
                                                  stream, rid)
            return
        if stream.call_id != rid or stream.accepted or stream.ended.is_set():
            return
        stream.call_id = ""  # its call's end (cancelled) is not a failure to act on
        self.sink.unregister(rid)
        cancel_call(stream.call, self.sink, rid)
        stream.fail(AtCapacity(f"request {stream.request_id}: no decode replica took it within "
                               f"{self.queue_timeout_s:g} s", self.retry_after_s))
        stream.ended.set()
        stream.call_done.set()

    def _if_silent(self, stream: RequestStream, rid: str) -> None:
        """A decode call no replica has taken yet (Serve holds calls while none of the
        deployment's replicas runs): is any decode replica alive? Asked again every
        ``DECODE_SILENT_S`` until one takes it, moved requests' calls too (they have tokens:
        a request moved onto a pool whose only replica is still starting)."""
        if stream.call_id == rid and not stream.accepted and not stream.ended.is_set() \
                and not stream.cancelled:
            asyncio.ensure_future(self._check_decode())
            asyncio.get_running_loop().call_later(DECODE_SILENT_S, self._if_silent, stream, rid)

    def _call_with_own_id(self, pool, req: GenerateRequest):
        from dataclasses import replace

        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id

        current = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(
            replace(current, _internal_request_id=generate_request_id()))
        return pool.generate.remote(req)

    async def _follow(self, stream: RequestStream, rid: str) -> None:
        """The call's outcome: a lost replica moves the request; another error fails the stream
        (its result will not come)."""
        try:
            await stream.call
        except BaseException as exc:  # noqa: BLE001 - the writer raises it
            if stream.call_id != rid:
                return  # moved elsewhere already (the decode pool went down)
            self.sink.unregister(rid)
            if replica_lost(exc) and stream.pool is self.decode and self.fallback is not None:
                await self._check_decode()
            if replica_lost(exc) and stream.call_id == rid and await self._may_migrate(stream):
                if stream.call_id == rid:
                    self._move(stream, f"replica lost ({type(exc).__name__}: {exc})")
                return
            if stream.call_id != rid:
                return  # moved meanwhile (the decode pool found down): the new call decides
            stream.fail(exc)
            stream.ended.set()
            stream.call_done.set()
            return
        if stream.call_id == rid:
            stream.call_done.set()  # the result comes on the channel (or it was lost there)

    async def _channel_lost(self, stream: RequestStream, rid: str) -> None:
        """The connection that carried the request's tokens dropped. While its call runs, the
        call fails too (and ``_follow`` moves the request); once the call has returned, the
        rest was in that connection: move an unfinished request, end a finished one."""
        if stream.call_id != rid or stream.ended.is_set():
            return
        await stream.call_done.wait()
        if stream.call_id != rid or stream.ended.is_set():
            return  # moved by _follow, or its result came after all
        self.sink.unregister(rid)
        if stream.finished:
            stream.ended.set()
        elif await self._may_migrate(stream):
            if stream.call_id == rid:  # not moved meanwhile (the decode pool found down)
                self._move(stream, "token channel lost after its call ended")
        elif stream.call_id == rid:  # (moved during the pause: the new call decides)
            stream.fail(TokenChannelLost(f"request {stream.request_id}: its token channel "
                                         "closed before its last tokens"))
            stream.ended.set()

    async def _check_decode(self) -> None:
        """A decode call was lost with its replica, or has no first token yet: is any decode
        replica alive? If none answers, the decode pool is down until one does (one question
        at a time): the requests on it move to the prefill replicas."""
        if self.decode_down:
            return
        if await self._decode_alive() or self.decode_down:
            return
        self.decode_down = True
        log.warning("no decode replica answers: whole requests go to the prefill replicas "
                    "until one does")
        self._probe = asyncio.ensure_future(self._until_decode_answers())
        for stream in list(self._streams.values()):
            if stream.pool is self.decode and not (stream.finished or stream.cancelled
                                                   or stream.ended.is_set()):
                old, old_id = stream.call, stream.call_id
                self.sink.unregister(old_id)
                self._move(stream, "no decode replica answers", own_id=True)  # from this task
                cancel_call(old, self.sink, old_id)

    async def _decode_answers(self) -> bool:
        return await any_replica_answers(self.decode, DECODE_PROBE_TIMEOUT_S)

    async def _until_decode_answers(self) -> None:
        while not await self._decode_answers():
            await asyncio.sleep(DECODE_PROBE_INTERVAL_S)
        self.decode_down = False
        log.warning("a decode replica answers again: requests go to the decode replicas")

    def _move(self, stream: RequestStream, why: str, own_id: bool = False) -> None:
        """Submit the request again for what it still lacks (migration)."""
        log.warning("request %s: %s; moving it with %d tokens", stream.request_id, why,
                    len(stream.token_ids))
        stream.migrations += 1
        stream.moved_at.append(time.time())
        self._submit(stream, own_id)

    @staticmethod
    async def _may_migrate(stream: RequestStream) -> bool:
        """Whether to move the request (after a pause, so Serve can learn of the death)."""
        if stream.finished or stream.cancelled or stream.migrations >= MAX_MIGRATIONS:
            return False
        pause = MIGRATION_BACKOFF_S[min(stream.migrations, len(MIGRATION_BACKOFF_S) - 1)]
        if time.monotonic() + pause >= stream.deadline:
            return False
        await asyncio.sleep(pause)
        return not (stream.finished or stream.cancelled)

    async def result(self, stream: RequestStream) -> GenerateResult | None:
        """The request's result once it has finished (None if it was cancelled). It follows
        the last tokens on the same connection, so it is there or about to be; the wait is
        bounded by the request's deadline."""
        if not stream.cancelled and not stream.ended.is_set():
            try:
                await asyncio.wait_for(stream.ended.wait(),
                                       max(stream.deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                pass
        return stream.result

    def close(self, stream: RequestStream) -> None:
        """The writer is done (or gone): stop routing its tokens, cancel what still runs."""
        self.sink.unregister(stream.call_id)
        self._streams.pop(stream.request_id, None)
        stream.cancelled = stream.cancelled or not stream.finished
        if not stream.finished:  # a finished request's call ends by itself
            stream.cancel()

