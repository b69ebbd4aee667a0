"""The decode role as it ships: reserves KV blocks, has a prefill replica fill them, decodes,
and sends every engine step's tokens to the ingress over the token channel.

A request runs as every streamed request does (:mod:`contracts.streamed`); this role's part is
where its prompt is prefilled. Queues per request: the Serve call arrives naming its ingress's
token sink → dial it (once per ingress replica) and route the request to that connection →
:meth:`DecodeServer.reserve`
reserves blocks (local prefix hits are kept, not asked for) and leases them to the KV endpoint
in one engine command → call a prefill replica with the destination (with ``early_start``, also
sent to it ahead of the call over this replica's own token sink) → the prefill's first token,
which comes on that sink as the prefill step ends, is published at once → the KV lands and the
answer comes (on the sink, ahead of the call's return) → the request joins the running batch →
after each engine step the publisher packs that step's tokens, one frame per ingress
replica, on the engine thread → once the request has ended, its :class:`GenerateResult` follows
its last tokens on the same connection (the Serve call returns nothing). In colocated mode, when
blocks cannot be reserved right now, or when the prefill replica refuses the call (its queue is
full) or is gone, the request is prefilled here. When blocks cannot be reserved right now, a
prefill replica still makes the first token (``FirstTokenRequest``, no KV moved), published at
once while the prompt waits here for room (``first_token_while_queued``).

Each hand-over is one state machine, :class:`~decode_worker.handover.HandOver`, advanced on the
engine thread (:mod:`decode_worker.handover`); this side keeps, per request, that machine's
future and the prefill call it is waiting for. :meth:`DecodeServer.abort` works wherever the
request is and is harmless twice. A request abandoned while a prefill replica may still be
writing into its blocks (one-sided transports) keeps them fenced until that replica answers (or,
at the latest, the longest a sender keeps a write past its deadline has passed); so does a
lease that reaches its deadline while the call runs, whose request is prefilled here at once
meanwhile. A late write can never land in blocks another request has been given.
"""

from __future__ import annotations

import asyncio
import time

from contracts.messages import (DecodeTiming, FirstTokenRequest, GenerateRequest,
                                PrefillRequest, PrefillResult, serve_logger)
from contracts.streamed import LOCAL, REMOTE, Placement, StreamedRequests, retrieved
from contracts.token_channel import TokenPublisher, TokenSink, early_router
from contracts.metrics import EngineMetrics, PlacementMetrics, TransferMetrics, replica_id
from contracts.role import SharedAnswer, any_replica_answers, load_report, role_gone
from engine.async_engine import AsyncEngine
from engine.errors import RequestIdInUse
from engine.sampling_params import SamplingParams
from decode_worker.handover import HandOvers, State
from decode_worker.placement import DisaggregationConfig, Placer
from kvtransfer import (KVDestination, LayoutMismatchError, Transfer, TransferError,
                        TransportUnavailableError, endpoint_for)
from kvtransfer.directory import PeerDirectory, Publisher
from kvtransfer import endpoint as kv_endpoint

log = serve_logger(__name__)
COLOCATED = Placement(LOCAL, "colocated")
NO_ROOM = Placement(LOCAL, "no_room")  # to be handed over, but blocks or slots are short here
PROBE_INTERVAL_S = 0.5  # while no prefill replica answers: how often to ask again
PROBE_TIMEOUT_S = 1.0
# A prefill call silent this long makes the replica ask whether the prefill pool is gone for
# certain (no live replica actor): Serve routes calls to a dead replica, and fails them, only
# seconds later (7.8 s measured on CPU), where this gives up on them in about one.
SILENT_CALL_S = 1.0


class PrefillPoolGone(Exception):
    """No prefill replica is alive (the cluster lists none, or every one listed is dead)."""


def replica_gone(exc: BaseException) -> bool:
    """The prefill replica that was called is dead (not merely full)."""
    from ray.exceptions import RayActorError

    return isinstance(exc, (RayActorError, PrefillPoolGone))


def prefill_unavailable(exc: BaseException) -> bool:
    """The prefill replica refused the call (its queue is full), is gone, has no transport to
    this replica (``TransportUnavailableError``, for example ``cuda_ipc`` across nodes), got to
    the push only after its deadline (``PushNotStarted``: a call queued while a replica
    restarts), or its push failed (``TransferError``: the replica answers only once every part
    of it has ended, for example one rank's part of a tensor-parallel hand-over). In each case
    nothing can still write into our blocks (a refused push never started; a dead writer writes
    no more; an answered push is over), so the decode replica can release the lease and
    prefill the request itself at once.

    Not a :class:`LayoutMismatchError`: the two roles disagree on the KV layout, a configuration
    error that would make every request prefill here without a word; the request fails, loudly
    and counted, instead."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, LayoutMismatchError):
        return False
    return isinstance(exc, (BackPressureError, RayActorError, TransferError, PrefillPoolGone))


class DecodeServer(StreamedRequests):
    """Engine in the decode role; ``prefill`` is the prefill deployment's handle (or None for
    colocated mode)."""

    def __init__(self, config, backend: str, prefill=None, transfer_timeout_s: float = 30.0,
                 directory: PeerDirectory | None = None,
                 disaggregation: DisaggregationConfig | None = None,
                 channel_host: str = "127.0.0.1", early_start: bool = True, **endpoint_kwargs):
        """``directory``: where this replica's KV endpoint is listed, so prefill replicas open
        their links to it before the first request (``kvtransfer.directory``);
        ``disaggregation``: where each request is prefilled (``decode_worker.placement``);
        ``channel_host``: the address of this replica's own token sink, where prefill replicas
        answer hand-overs ahead of their calls' returns; ``early_start``: hand-overs are also
        sent over it ahead of their calls (``router.early_start``)."""
        publisher = TokenPublisher(replica_id() or None)
        super().__init__(AsyncEngine(config, on_outputs=publisher.publish,
                                     on_error=publisher.fail_all), publisher, COLOCATED,
                         replica_id())
        self.prefill = prefill
        self.timeout_s = transfer_timeout_s
        self.placer = Placer(disaggregation)
        self._probe: asyncio.Future | None = None  # the prefill replicas' probe, while down
        # Is the prefill pool gone? One question for every silent call.
        self._prefill_gone = SharedAnswer(lambda: role_gone(self.prefill, PROBE_TIMEOUT_S),
                                          PROBE_INTERVAL_S)
        self.endpoint = self.handovers = None
        self._calls: dict[str, tuple] = {}  # request id -> (its hand-over, its prefill call)
        self._early: dict[str, asyncio.Future] = {}  # request id -> its first-token call (no room)
        # request id -> the end of a run's prefill call that still runs after its hand-over was
        # aborted or released (its blocks fenced on a one-sided transport): a later run of the
        # id waits for it (the blocks, the late answer and the transfer id are that run's)
        self._fenced: dict[str, asyncio.Future] = {}
        self._waiting: set[str] = set()  # the later runs waiting for them
        self.sink = TokenSink(channel_host, early_start) if prefill is not None else None
        if prefill is not None:
            self.endpoint = endpoint_for(self.aengine.engine.kv_cache_spec(), backend, polled=True,
                                         **endpoint_kwargs)
            self.handovers = HandOvers(self.endpoint, self.publisher.publish)
            self.aengine.add_ticker(self.endpoint.poll)
            self.aengine.add_ticker(lambda: self.handovers.expire_fences(self.aengine.engine))
        self.listing = (Publisher(directory, self.endpoint.info()).start()
                        if directory is not None and self.endpoint is not None else None)
        self.metrics = self.transfers = None
        if self.replica:  # a Serve replica: its own series, through Ray's metrics system
            self.metrics = EngineMetrics(self.aengine.feed, self.aengine.info, extra=lambda: {
                "kv_blocks_held_by_transfers": self.held_blocks}).start()
            self.transfers = TransferMetrics("received") if prefill is not None else None
            self.placements = PlacementMetrics()

    def close(self) -> None:
        """At shutdown (Serve calls the deployment's ``__del__`` once it has drained): leave the
        directory, stop the engine thread, then fail every transfer still pending, so blocks
        and leases on both sides are released now rather than at their deadlines."""
        if self.listing is not None:
            self.listing.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self._probe is not None:
            self._probe.cancel()
        self.aengine.shutdown()
        if self.handovers is not None:
            self.handovers.closing = True
        if self.endpoint is not None:
            self.endpoint.close()
        if self.sink is not None:
            self.sink.close_soon()

    @property
    def held_blocks(self) -> int:
        """Blocks leased to hand-overs, and those fenced after one (a late write's)."""
        if self.endpoint is None:
            return 0
        return self.endpoint.held_blocks + self.handovers.num_fenced_blocks

    def kv_load(self) -> dict:
        return load_report(self.aengine, self.endpoint)

    async def _prefill_elsewhere(self, req: GenerateRequest, prompt: list[int],
                                 timing: DecodeTiming) -> tuple[PrefillResult | None, Placement]:
        if (fenced := self._fenced.get(req.request_id)) is not None:
            # An earlier run of this id (an early start dropped before its call came) still
            # waits for its prefill call, its hand-over's blocks fenced: this run starts once
            # that call has ended (its answer, which this run would take for its own, has come)
            # and the blocks are released, instead of being refused (bounded: the lease, then
            # the longest a sender keeps a write past its deadline).
            self._waiting.add(req.request_id)  # (kept if cancelled: abort takes it)
            await asyncio.wait({fenced},
                               timeout=self.timeout_s + kv_endpoint.late_write_bound_s())
            self._waiting.discard(req.request_id)
        if self.prefill is None:
            return None, self.placement
        if req.params.prompt_logprobs is not None:  # made where the prompt is computed: here
            return None, Placement(LOCAL, "prompt_logprobs")
        return await self._remote_prefill(req, prompt, timing)

    def _prefilled_here(self, uncached_tokens: int, seconds: float) -> None:
        self.placer.prefilled_here(uncached_tokens, seconds)

    def _queue_here(self, engine, prompt: list[int], params, rid: str) -> None:
        engine.add_request(prompt, params, rid)
        first = self.handovers.published_first(rid) if self.handovers is not None else None
        if first is not None:  # a released hand-over published it: the prompt goes on from it
            engine.take_first_token(rid, *first)

    def _first_token_ahead(self, delta, timing: DecodeTiming) -> None:
        """On the sink (event loop): a hand-over's first token, which its prefill replica sends
        as the step that sampled it ends, ahead of the push. Published at once by the engine
        thread (``HandOvers.first_token``); the answer brings it where it cannot be."""
        if not delta.token_ids:
            return
        timing.first_arrived = timing.first_arrived or time.time()
        rid, token = delta.request_id, delta.token_ids[0]
        logprob = delta.logprobs[0] if delta.logprobs else None
        top = [tuple(p) for p in delta.top_logprobs[0]] if delta.top_logprobs else None
        if self.aengine.error is None:
            self.aengine.submit(lambda e: self.handovers.first_token(e, rid, token, logprob, top))

    async def _remote_prefill(self, req: GenerateRequest, prompt: list[int],
                              timing: DecodeTiming) -> tuple[PrefillResult | None, Placement]:
        """Decide where the request is prefilled; if by a prefill replica: reserve, have it
        push, admit (publishing the prefill's first token). The result is None when the
        request is prefilled here: decided so (it is queued here already), no blocks could be
        reserved right now, or the prefill replica could not deliver.

        With ``early_start``, the hand-over goes to the prefill replica over this replica's
        sink ahead of its call: after the reservation, or, where nothing here can keep the
        prompt from being handed over but a lack of room (``Placer.remote_for_certain``),
        before it, while the engine thread reserves (its blocks then come with the call, whose
        claim the push waits for anyway). A reservation that finds no room withdraws it."""
        rid = req.request_id
        router = early_router(getattr(self.prefill, "deployment_name", None)) \
            if self.sink.early_start else None
        answer = asyncio.get_running_loop().create_future()
        ahead, sent = router is not None and self.placer.remote_for_certain, False
        reply_to = await self.sink.start() if ahead else None
        if ahead:
            self._expect_answer(rid, answer, timing)
        placing = self._place(prompt, req.params, rid, timing)  # queued on the engine now
        if ahead:  # its first token's command is queued after the reservation's
            dest = KVDestination(rid, self.endpoint.endpoint_id, (), 0,
                                 time.time() + self.timeout_s)
            sent_at = time.time()  # (before the send: the prefill replica stamps its arrival)
            sent = router.start_early(PrefillRequest(tuple(prompt), req.params, dest,
                                                     self.endpoint.info(), reply_to))
        try:
            placement, h, uncached = await placing
        except BaseException:
            self._withdraw_early(router, rid, sent)
            raise
        if h is None:
            self._withdraw_early(router, rid, sent)
            if placement is NO_ROOM and self.placer.config.first_token_while_queued:
                early = self._early[rid] = asyncio.ensure_future(
                    self._first_token_by_prefill(req, prompt, uncached, timing))
                early.add_done_callback(lambda done: self._forget(self._early, rid, done))
            return None, placement
        timing.prefill_called = sent_at if sent else time.time()  # its hand-over's first send
        reply_to = reply_to or await self.sink.start()
        preq = PrefillRequest(tuple(prompt), req.params, h.dest, self.endpoint.info(), reply_to)
        if not ahead:
            self._expect_answer(rid, answer, timing)
            if router is not None:  # the prefill replica starts while the call travels
                router.start_early(preq)
        call = asyncio.ensure_future(self.prefill.prefill.remote(preq))  # a Serve response
        self._calls[rid] = (h, call)
        self.placer.sent(uncached)
        try:
            result = await self._handed_over(rid, h, call, answer, timing)
        finally:
            self.sink.unregister(rid)
            self.placer.answered(uncached, delivered=bool(timing.prefill_returned))
        return result, (placement if result is not None else
                        Placement(LOCAL, "prefill_unavailable"))

    def _expect_answer(self, rid: str, answer: asyncio.Future, timing: DecodeTiming) -> None:
        """The sink takes the hand-over's first token and its answer from now on."""
        self.sink.register(rid, lambda d, _at: self._first_token_ahead(d, timing),
                           lambda d: answer.done() or answer.set_result(d))

    def _withdraw_early(self, router, rid: str, sent: bool) -> None:
        """A hand-over sent ahead of its reservation, which found no room (or was abandoned):
        no call follows, so its prefill replica drops it and frees its blocks now."""
        self.sink.unregister(rid)
        if sent:
            router.withdraw_early(rid)

    def _place(self, prompt: list[int], params: SamplingParams, rid: str,
               timing: DecodeTiming):
        """One engine command, queued now: where the prompt is prefilled (its uncached part
        against the local queue, :class:`~decode_worker.placement.Placer`), then either queued
        here or its blocks reserved and leased for a hand-over (an awaitable of
        ``(placement, hand-over, uncached tokens)``)."""
        deadline = time.time() + self.timeout_s
        loop = asyncio.get_running_loop()

        def place(engine):
            uncached = len(prompt) - engine.kv_manager.cached_tokens(prompt)
            step_s = engine.step_cost.estimate(min(uncached, engine.config.max_num_batched_tokens))
            placement = self.placer.decide(uncached, engine.scheduler.queued_prompt_tokens(),
                                           step_s)
            if placement.where == REMOTE:
                h = self.handovers.reserve(engine, prompt, params, rid, deadline, loop)
                if h is not None:
                    timing.reserved = time.time()
                    return placement, h, len(prompt) - h.dest.num_present_tokens
                placement = NO_ROOM  # blocks or slots short right now
            engine.add_request(prompt, params, rid)
            timing.queued = time.time()
            return placement, None, uncached

        return self._request_command(rid, place)

    async def _first_token_by_prefill(self, req: GenerateRequest, prompt: list[int],
                                      uncached: int, timing: DecodeTiming) -> None:
        """No room here: the prompt waits in the local queue while a prefill replica makes its
        first token, published at once unless the request has started here by then (its own
        first token then comes from this engine). A call that fails changes nothing: the
        prompt is computed here as it would have been."""
        rid = req.request_id
        called = time.time()
        self.placer.sent(uncached)
        delivered = False
        try:
            result = await asyncio.wait_for(asyncio.ensure_future(self.prefill.first_token.remote(
                FirstTokenRequest(tuple(prompt), req.params, rid))), self.timeout_s)
            delivered = True
        except Exception as exc:  # noqa: BLE001 - the local prefill goes on
            if replica_gone(exc):
                self._prefill_down()
            log.info("request %s: no first token from a prefill replica (%s); it comes from "
                     "here", rid, type(exc).__name__)
            return
        finally:
            self.placer.answered(uncached, delivered)
        returned = time.time()

        def take(engine):  # on the engine thread: published before any later step's tokens
            out = engine.take_first_token(rid, result.first_token, result.first_logprob,
                                          result.first_top_logprobs)
            if out is not None:  # the request's timing tells of this call only if it counted
                timing.first_token_by_prefill = True
                timing.prefill_called, timing.prefill_returned = called, returned
                timing.prefill = result.timing
                self.publisher.publish([out])

        await self.aengine.call(take)

    async def generate(self, req: GenerateRequest):
        try:
            return await super().generate(req)
        finally:  # its first token came from here first: the prefill replica's is not needed
            if (early := self._early.pop(req.request_id, None)) is not None:
                early.cancel()

    def _request_command(self, rid: str, fn):
        """``fn(engine)`` for request ``rid``, queued on the engine thread now; an awaitable of
        its result. If the caller goes away while it waits (or the command fails), the request
        is aborted: the command may still run, the abort is queued after it."""
        return self._aborting(rid, asyncio.wrap_future(self.aengine.submit(fn)))

    async def _aborting(self, rid: str, result: asyncio.Future):
        try:
            return await result
        except RequestIdInUse:  # the id is another run's: that one is left alone
            raise
        except BaseException:
            self.abort(rid)
            raise

    @staticmethod
    def _forget(entries: dict, rid: str, entry) -> None:
        """Drop ``entries[rid]`` if it is still ``entry`` (not a later run's)."""
        if entries.get(rid) is entry:
            del entries[rid]

    async def _handed_over(self, rid: str, h, call: asyncio.Future, answer: asyncio.Future,
                           timing: DecodeTiming) -> PrefillResult | None:
        """The prefill call and the lease, to the admission; None: prefill here instead.
        ``answer``: the prefill replica's answer on this replica's sink, which comes ahead of
        the call's return (the same answer) when that replica is connected to the sink."""
        # The answer carries the first token; the lease may end before it (its deadline: a
        # frozen or slow prefill replica). A cancel here leaves the call running: the caller's
        # abort decides about it.
        while not (await asyncio.wait({call, answer, h.outcome}, timeout=SILENT_CALL_S,
                                      return_when=asyncio.FIRST_COMPLETED))[0]:
            if await self._prefill_gone.get():  # a dead writer writes no more
                call.cancel()
                return self._call_failed(rid, PrefillPoolGone("no prefill replica is alive"))
        if (h.outcome.done() and h.fence is not None) or not (answer.done() or call.done()):
            # Released (its deadline) while the call ran, even if its answer came meanwhile:
            # prefilled here. On a one-sided transport its blocks stay fenced until the call
            # ends, and a later run of the id (an early start's call) waits for that too: the
            # late answer, or the transport's word, names this id's transfer.
            self._calls.pop(rid, None)
            self._fence_until_over(rid, h, call)
            self._count_failure("deadline")
            log.warning("request %s: no KV from the prefill replica by the deadline (%s); "
                        "prefilling here", rid, h.reason)
            return None
        if answer.done():  # its push has ended DONE; the call's return (the same) follows
            call.add_done_callback(retrieved)
            self._calls.pop(rid, None)
            result = PrefillResult.from_wire(answer.result())
            return await self._answered(rid, h, result, timing)
        if (exc := call.exception()) is not None:
            return self._call_failed(rid, exc)
        self._calls.pop(rid, None)
        return await self._answered(rid, h, call.result(), timing)

    async def _answered(self, rid: str, h, result: PrefillResult,
                        timing: DecodeTiming) -> PrefillResult:
        """The prefill replica has pushed the KV and sampled the first token: admit."""
        timing.prefill_returned, timing.prefill = time.time(), result.timing

        def answered(engine):
            timing.queued = time.time()
            self.handovers.answered(engine, rid, result)

        await self.aengine.call(answered)
        if (await h.outcome).state is not State.ADMITTED:
            raise TransferError(f"KV of {rid} did not land: {h.reason}")
        if self.transfers is not None:
            self.transfers.record(result.stats)
        return result

    def _call_failed(self, rid: str, exc: BaseException) -> None:
        """The prefill call raised: the lease ends (nothing can still write). A replica that
        could not deliver means a local prefill (None); anything else fails the request."""
        self._calls.pop(rid, None)
        self._count_failure(type(exc).__name__)
        self.aengine.submit(lambda e: self.handovers.call_ended(e, rid, "prefill failed"))
        if prefill_unavailable(exc):  # the release is queued before the local prefill
            if replica_gone(exc):
                self._prefill_down()
            if isinstance(exc, TransportUnavailableError):
                log.warning("request %s: %s; prefilling here", rid, exc)
            else:
                log.info("request %s: prefill replica unavailable (%s); prefilling here", rid,
                         type(exc).__name__)
            return None
        if isinstance(exc, LayoutMismatchError):
            log.error("request %s: the prefill replica refused this replica's KV layout (a "
                      "configuration error: both roles must serve the same model, dtype, KV "
                      "cache dtype and block size): %s", rid, exc)
        raise exc

    async def _unfence_when_over(self, h, call: asyncio.Future) -> None:
        """A hand-over released while its prefill call runs. On a one-sided transport its
        blocks were fenced (``HandOvers._fence``: a write in flight at the sender's deadline
        runs to its end, and the sender answers only once it has): they come back when the
        call ends, or at the latest once the longest a sender keeps such a write has passed
        (a frozen prefill replica never answers; its copies have ended long before). The call
        is then dropped."""
        if h.fence is not None:
            # (HandOvers ends the fence then anyway)
            await asyncio.wait({call}, timeout=kv_endpoint.late_write_bound_s())
        call.cancel()
        call.add_done_callback(retrieved)
        if h.fence is not None and self.aengine.error is None:
            self.aengine.submit(lambda e: self.handovers.unfence(e, h))

    def _prefill_down(self) -> None:
        """A prefill replica is gone: until one answers again, prompts are prefilled here (Serve
        keeps routing calls to a dead replica until its controller notices, seconds later).
        One probe loop at a time: a trivial call every ``PROBE_INTERVAL_S``."""
        self.placer.prefill_down = True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._until_prefill_answers())

    async def _until_prefill_answers(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if not await any_replica_answers(self.prefill, PROBE_TIMEOUT_S):
                continue  # gone, or still starting
            self.placer.prefill_down = False
            log.info("a prefill replica answers again: handing prompts over again")
            return

    def _count_failure(self, kind: str) -> None:
        if self.transfers is not None:
            self.transfers.failed(kind)

    # -- the hand-over's verbs, for the roles' tests and tools --------------------------------
    async def reserve(self, prompt: list[int], params: SamplingParams, request_id: str,
                      timeout_s: float | None = None) -> KVDestination | None:
        """Reserve blocks for the part of ``prompt`` the local prefix cache lacks and lease
        them to the KV endpoint until ``timeout_s`` (the server's transfer timeout by default),
        in one engine command. None when blocks or sequence slots are short right now."""
        deadline = time.time() + (self.timeout_s if timeout_s is None else timeout_s)
        loop = asyncio.get_running_loop()
        h = await self._request_command(request_id, lambda e: self.handovers.reserve(
            e, prompt, params, request_id, deadline, loop))
        if h is None:
            return None
        self._calls[request_id] = (h, None)
        return h.dest

    async def landed(self, request_id: str) -> Transfer:
        """The request's lease, once its hand-over has ended (admitted or released)."""
        h, _ = self._calls[request_id]
        return (await h.outcome).transfer

    def abort(self, request_id: str) -> None:
        """Stop the request wherever it is (reserving, leased, landing, decoding); harmless
        twice. A hand-over whose prefill call is still running on a one-sided transport keeps
        its blocks fenced until the prefill replica answers (its push is then over);
        everything else is released at once."""
        if self.handovers is None:
            self.aengine.abort(request_id)
            return
        if (early := self._early.pop(request_id, None)) is not None:
            early.cancel()
        h, call = self._calls.pop(request_id, (None, None))
        if self.aengine.error is not None:
            return
        if h is None and request_id in self._waiting:  # a later run cancelled while it waited
            self._waiting.discard(request_id)  # for an earlier run's call: it took nothing,
            return  # and that run's hand-over (its blocks, fenced) is left alone
        running = call is not None and not call.done()
        self.aengine.submit(lambda e: self.handovers.abandon(e, request_id, running))
        if running:  # a later run of the id waits for it (its answer, its blocks)
            self._wait_for(request_id, self._end_when_answered(h, call))

    def _fence_until_over(self, rid: str, h, call: asyncio.Future) -> None:
        """The hand-over ended while its call runs: its blocks come back once the call has
        ended (:meth:`_unfence_when_over`), and a later run of the id waits for that."""
        if call.done() and h.fence is None:
            return
        self._wait_for(rid, self._unfence_when_over(h, call))

    def _wait_for(self, rid: str, ending) -> None:
        """A later run of ``rid`` waits for ``ending`` (an earlier run's call) to end."""
        ended = self._fenced[rid] = asyncio.ensure_future(ending)
        ended.add_done_callback(lambda done: self._forget(self._fenced, rid, done))

    async def _end_when_answered(self, h, call: asyncio.Future) -> None:
        """An abandoned hand-over's call, still running: once it has answered (its push is
        over, landed or failed) the fenced lease ends; if the lease ends first (its deadline),
        its blocks stay fenced until the call ends (:meth:`_unfence_when_over`). Returns once
        both have."""
        await asyncio.wait({call, h.outcome}, return_when=asyncio.FIRST_COMPLETED)
        if h.outcome.done():
            await self._unfence_when_over(h, call)
        elif self.aengine.error is None:
            self.aengine.submit(lambda e: self.handovers.call_ended(
                e, h.request_id, "request aborted; its prefill has answered"))
            await asyncio.wait({h.outcome}, timeout=self.timeout_s)

