"""Whole requests run on a role's engine, their tokens streamed to the requester: what a decode
replica does with every request and a prefill replica with the requests it decodes itself while
no decode replica answers (``prefill_worker.server``).

Per request: the Serve call names the requester's token sink → dial it (once per requester) and
route the request to that connection → the prompt is prefilled elsewhere (a role's hook: the
decode role's hand-over) or queued on this engine → after each engine step the publisher packs
that step's tokens, one frame per connection, on the engine thread → once the request has
ended, its :class:`GenerateResult` follows its last tokens on the same connection (the Serve
call returns nothing). Bad input only a replica can check (:class:`BadRequest`) is answered the
same way; any other failure aborts the request here and raises.

Early starts (:mod:`contracts.token_channel`, :class:`EarlyStarts`): a request the ingress sent
ahead of its Serve call over the token channel starts at once, its frames held by the publisher;
its Serve call claims it (the frames go out, the call then follows the running request as if it
had started it). One never claimed within ``EARLY_CLAIM_S``, or withdrawn by the ingress (its
call went to another replica), is cancelled like a call that went away: aborted, its blocks
freed, nothing of it sent. A request id is started once: an early start that comes after its
call is ignored. A prefill replica's :class:`EarlyStarts` also takes hand-overs sent ahead by
decode replicas (``prefill_worker.server``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from contracts.messages import (TIMELINE, DecodeTiming, GenerateRequest, GenerateResult,
                                PrefillResult, TransferSummary, serve_logger, timeline)
from contracts.metrics import EarlyStartMetrics
from contracts.token_channel import TokenPublisher
from engine.errors import BadRequest, RequestIdInUse
from engine.outputs import RequestOutput

log = serve_logger(__name__)
LOCAL, REMOTE = "local", "remote"
# An early start whose Serve call has not come by then is cancelled (the call comes within
# milliseconds unless Serve routed it elsewhere; the ingress then withdraws it sooner).
EARLY_CLAIM_S = 5.0
RECENT_IDS = 4096  # request ids remembered, so a late early start never runs one twice


@dataclass(frozen=True)
class Placement:
    """Where a request's prompt was prefilled, and why (``decode_worker.placement`` decides)."""

    where: str  # LOCAL or REMOTE
    reason: str  # short | saturated | never | always | long | colocated | decode_down | ...


class EarlyStarts:
    """A replica's requests sent ahead of their Serve calls over its publisher's connections
    (``router.early_start``): the runner of the request's type starts it at once (its frames
    held by the publisher where that type asks), and its Serve call claims it
    (:meth:`claim`). One never claimed within ``EARLY_CLAIM_S``, or withdrawn by its sender
    (its call went to another replica), is cancelled like a call that went away: nothing of it
    is sent. A request id is started once: an early start that comes after its call
    (:meth:`remember`) is ignored.

    A runner, ``runner(request, route) -> (coroutine, state)``, makes the request's run
    (started in a context of its own) and what its claim hands back beside the task. Its type
    is in ``runners`` (the runner and whether the publisher holds the request's frames until
    the claim)."""

    def __init__(self, publisher: TokenPublisher, replica: str | None = None):
        self.publisher = publisher
        self.runners: dict[type, tuple[Callable, bool]] = {}
        # by request id: (its task, its timer, its runner's state, its sink's id)
        self.unclaimed: dict[str, tuple[asyncio.Task, asyncio.TimerHandle, object, str]] = {}
        self.running: dict[str, tuple[asyncio.Task, str]] = {}  # calls: (task, its sink's id)
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # before their calls came
        self.counts = {"claimed": 0, "dropped": 0}
        self._metrics = EarlyStartMetrics() if replica else None
        publisher.on_submit, publisher.on_withdraw = self._start, self.withdraw
        publisher.on_cancel = self.cancel

    def _start(self, conn, req) -> None:
        """A request sent ahead of its Serve call over ``conn`` (event loop)."""
        runner, held = self.runners.get(type(req), (None, True))
        rid = req.request_id
        if runner is None or rid in self._recent or req.reply_to is None or \
                req.reply_to.sink_id != conn.address.sink_id:
            return  # its call came first (or the request names another sink)
        dest = getattr(req, "dest", None)
        if dest is not None and dest.expired():  # a hand-over whose lease has ended (read by a
            return  # replica that was stopped): nothing of it could be pushed any more
        self.remember(rid)
        route = self.publisher.route(rid, conn, held=held)
        coro, state = runner(req, route)
        # A context of its own: the connection's reader runs in the context of the call that
        # dialled it, whose Serve request id the role's own calls (to a prefill replica) would
        # otherwise share, and concurrent calls under one id collide in Serve's bookkeeping.
        loop = asyncio.get_running_loop()
        task = loop.create_task(coro, context=contextvars.Context())
        task.add_done_callback(retrieved)  # a dropped one's outcome is nobody's
        timer = loop.call_later(EARLY_CLAIM_S, self.withdraw, rid)
        self.unclaimed[rid] = (task, timer, state, conn.address.sink_id)

    def claim(self, rid: str) -> tuple[asyncio.Task, object] | None:
        """The Serve call of ``rid`` has come: its early start's task and state (None if it
        was not started early); what the start held goes out now."""
        early = self.unclaimed.pop(rid, None)
        if early is None:
            return None
        task, timer, state, _ = early
        timer.cancel()
        self._count("claimed")
        self.publisher.claim(rid)
        return task, state

    def withdraw(self, rid: str) -> None:
        """An early start whose call went elsewhere, or never came: cancelled, nothing sent."""
        early = self.unclaimed.pop(rid, None)
        if early is None:
            return
        task, timer, *_ = early
        timer.cancel()
        self._count("dropped")
        self.publisher.drop(rid)
        task.cancel()

    def remember(self, rid: str) -> None:
        """``rid``'s call has come (or its early start): it never starts again here."""
        _bounded_add(self._recent, rid)

    def cancel(self, conn, rid: str) -> None:
        """The sender no longer wants ``rid`` (its client went, or a stop string ended it), said
        over the channel beside its Serve call's cancel, which is best effort: Serve drops it
        when it comes while the call is being handed to this replica (the call then runs to
        its end, though nobody reads it). The request stops, started early or by its call;
        one not here yet never starts (its early start is ignored, its call ends at once).
        Only the connection of the request's own sink may cancel it."""
        sink_id = conn.address.sink_id
        running, early = self.running.get(rid), self.unclaimed.get(rid)
        if running is not None or early is not None:
            if running is not None and running[1] == sink_id:
                running[0].cancel()
            elif early is not None and early[3] == sink_id:
                self.withdraw(rid)
                _bounded_add(self._cancelled, rid)
            return
        self.remember(rid)  # an early start that comes after this is not started
        _bounded_add(self._cancelled, rid)

    def was_cancelled(self, rid: str) -> bool:
        """Whether ``rid`` was cancelled over the channel before its call came here."""
        return self._cancelled.pop(rid, False) is None

    def follow(self, rid: str, sink_id: str, task: asyncio.Task) -> None:
        """``task`` runs ``rid``'s call (or the early start it claimed) until it ends."""
        self.running[rid] = (task, sink_id)

        def ended(_task):
            if self.running.get(rid, (None,))[0] is task:
                del self.running[rid]
        task.add_done_callback(ended)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._metrics is not None:
            self._metrics.record(outcome)


class StreamedRequests:
    """Runs whole requests on ``aengine``, whose outputs go to ``publisher``; ``placement``:
    where and why the requests it prefills itself are said to be prefilled; ``placements``: the
    counter of those (``contracts.metrics.PlacementMetrics``, or None)."""

    def __init__(self, aengine, publisher: TokenPublisher, placement: Placement,
                 replica: str | None = None, placements=None):
        self.aengine, self.publisher = aengine, publisher
        self.placement, self.replica, self.placements = placement, replica, placements
        self.early = EarlyStarts(publisher, replica)
        self.early.runners[GenerateRequest] = (self._start_early, True)

    @property
    def early_starts(self) -> dict:
        """Requests started early here, by outcome (``claimed``, ``dropped``)."""
        return self.early.counts

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Run the request to its end; its tokens, then its :class:`GenerateResult`, go to
        ``req.reply_to``. A request refused as bad input (:class:`BadRequest`: a grammar that
        does not compile, a prompt the KV cache cannot hold) gets its refusal there too; any
        other failure raises. A request started early is claimed and followed instead."""
        rid = req.request_id
        sink_id = req.reply_to.sink_id if req.reply_to is not None else ""
        early = self.early.claim(rid)
        if early is not None:
            task, timing = early
            if not task.done():  # an ended one's result went out (held) without it
                timing.claimed = time.time()
                self.early.follow(rid, sink_id, task)
            return await task  # cancelling this call cancels the request, as below
        if self.early.was_cancelled(rid):  # its sender's cancel came first (over the channel)
            raise asyncio.CancelledError(f"request {rid} was cancelled before its call came")
        self.early.remember(rid)
        self.early.follow(rid, sink_id, asyncio.current_task())
        timing = DecodeTiming(received=time.time(), replica=self.replica)
        route = self.publisher.route(rid, await self.publisher.connect(req.reply_to))
        return await self._run(req, route, timing)

    def _start_early(self, req: GenerateRequest, route):
        """An early start's run (:class:`EarlyStarts`): its timing is the claim's state."""
        timing = DecodeTiming(received=time.time(), replica=self.replica)
        return self._run(req, route, timing), timing

    async def _run(self, req: GenerateRequest, route, timing: DecodeTiming) -> GenerateResult:
        rid, prompt = req.request_id, list(req.prompt_token_ids)
        # An empty first delta: the ingress's word that a replica has taken the request (its
        # queue-time bound then stops, router.queue_timeout_s).
        self.publisher.publish([RequestOutput(rid, [])])
        prefilled: PrefillResult | None = None
        placement = self.placement
        try:
            await self.aengine.compile_grammar(req.params)  # off the engine thread
            prefilled, placement = await self._prefill_elsewhere(req, prompt, timing)
            if prefilled is None and not timing.queued:  # not handed over: prefill here
                def add(engine):  # stamped here: the first token may come before the loop runs
                    self._queue_here(engine, prompt, req.params, rid)
                    timing.queued = time.time()
                await self.aengine.call(add)
            if self.placements is not None:
                self.placements.record(placement.where, placement.reason)
            last = await route.done
        except BaseException as exc:
            self.publisher.unroute(rid)
            if not isinstance(exc, RequestIdInUse):  # (the id is another run's: left alone)
                self.abort(rid)
            timing.first_token, timing.finished = route.first_at, time.time()
            if isinstance(exc, BadRequest):  # the client's error: one line, answered in-band
                log.info("request %s refused: %s", rid, exc)
                result = GenerateResult(rid, len(prompt), 0, 0, None, timing=timing,
                                        error=str(exc))
                self.publisher.end(route, rid, result.to_wire())
                return result
            outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else \
                f"error {type(exc).__name__}"
            log_timeline(rid, outcome, timing, prefilled, None, placement)
            raise
        timing.first_token, timing.finished = route.first_at, time.time()
        if placement.where == LOCAL and timing.first_token and timing.queued and \
                not timing.first_token_by_prefill:
            self._prefilled_here(len(prompt) - last.num_cached_tokens,
                                 timing.first_token - timing.queued)
        log_timeline(rid, last.finish_reason, timing, prefilled, last.num_output_tokens,
                     placement)
        result = GenerateResult(
            request_id=rid, num_prompt_tokens=len(prompt),
            num_output_tokens=last.num_output_tokens, num_cached_tokens=last.num_cached_tokens,
            finish_reason=last.finish_reason,
            transfer=TransferSummary.of(prefilled.stats) if prefilled is not None else None,
            prefill_seconds=prefilled.prefill_seconds if prefilled is not None else 0.0,
            timing=timing, prefilled_where=placement.where, prefilled_why=placement.reason)
        self.publisher.end(route, rid, result.to_wire())
        return result

    async def _prefill_elsewhere(self, req: GenerateRequest, prompt: list[int],
                                 timing: DecodeTiming) -> tuple[PrefillResult | None, Placement]:
        """A role's hook: have the prompt prefilled by another replica (its result), or decide
        to prefill it here (None; ``timing.queued`` set if the hook queued it already)."""
        return None, self.placement

    def _queue_here(self, engine, prompt: list[int], params, rid: str) -> None:
        """A role's hook (engine thread): queue the request's prompt on this engine."""
        engine.add_request(prompt, params, rid)

    def _prefilled_here(self, uncached_tokens: int, seconds: float) -> None:
        """A role's hook: a prompt prefilled here took ``seconds`` to its first token."""

    def abort(self, request_id: str) -> None:
        """Stop the request wherever it is; harmless twice."""
        self.aengine.abort(request_id)


def _bounded_add(ids: OrderedDict, rid: str) -> None:
    ids[rid] = None
    ids.move_to_end(rid)
    if len(ids) > RECENT_IDS:
        ids.popitem(last=False)


def retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def log_timeline(rid: str, outcome: str | None, timing: DecodeTiming,
                 prefilled: PrefillResult | None, tokens: int | None,
                 placement: Placement) -> None:
    if not TIMELINE.isEnabledFor(logging.INFO):
        return
    where = f"prefilled here ({placement.reason})" if timing.queued else "not prefilled"
    if timing.first_token_by_prefill:
        where += ", its first token by a prefill replica"
    if prefilled is not None:
        st = prefilled.stats
        where = (f"prefilled remotely in {prefilled.prefill_seconds * 1e3:.1f} ms, "
                 f"{st.blocks_sent} blocks ({st.bytes} B, {st.blocks_skipped} skipped) over "
                 f"{st.backend} in {st.seconds * 1e3:.1f} ms")
    made = "" if tokens is None else f", {tokens} tokens"
    TIMELINE.info("request %s decode: %s%s, %s; %s", rid, outcome, made, where,
                  timeline(received=timing.received, claimed=timing.claimed,
                           prefill_called=timing.prefill_called,
                           prefill_returned=timing.prefill_returned, queued=timing.queued,
                           first_token=timing.first_token, finished=timing.finished))
