"""The prefill deployment: prompts in, KV pushed to a decode replica, first token out; and,
while no decode replica answers, whole requests decoded here (:meth:`PrefillServer.generate`,
the ingress's fallback), each holding a full engine.

Queues: a request joins the engine's batch (chunked prefill with the others) → stops after its
first token with its blocks held → the blocks the decode side lacks are pushed → the blocks go
back to the prefix cache once the push is terminal → ``PrefillResult`` returns. A caller that goes
away before the push starts gets its held blocks released; a push once started runs to its end
(the decode side's deadline bounds it) and releases them itself.

The decode replica's own token sink (``PrefillRequest.reply_to``), once this replica has
dialled it (in the background, on the first hand-over from that replica): the request's first
token goes there as its step ends (the engine's outputs are published like any streamed
request's), and the ``PrefillResult`` as soon as the push has ended, ahead of the return. A
hand-over sent there ahead of its call (``router.early_start``) is prefilled at once; its push
waits for the call's claim, so only the replica the call chose writes into the lease, and one
never claimed gives its held blocks back unpushed. The push writes into the blocks the call's
request names: a decode replica may send the hand-over before it has reserved them.

Where the push starts (``push_at_step_end``, the app's ``transfer.push_at_step_end``): by
default the event loop, woken by the request's end, asks the engine thread for it, which runs
it at its next turn (after the step in flight) and learns of the copy's end a turn later. With
``push_at_step_end`` the engine thread starts it as the step that prefilled the request returns
and waits for node-local copies (CUDA IPC) in its next poll: the answer leaves up to two steps
sooner, and the copies compete with the next step (measured in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import time

from contracts.messages import (TIMELINE, FirstTokenRequest, PrefillRequest, PrefillResult,
                                PrefillTiming, timeline)
from contracts.metrics import EngineMetrics, PlacementMetrics, TransferMetrics, replica_id
from contracts.role import load_report
from contracts.streamed import LOCAL, Placement, StreamedRequests, retrieved
from contracts.token_channel import TokenPublisher
from engine.async_engine import AsyncEngine, set_result_once
from kvtransfer import (EndpointInfo, PushNotStarted, TransferError, TransferState,
                        endpoint_for)
from kvtransfer.directory import LinkWarmer, PeerDirectory


class PrefillServer:
    """Engine in the prefill role plus its KV endpoint (used by the Serve deployment)."""

    def __init__(self, config, backend: str, directory: PeerDirectory | None = None,
                 push_at_step_end: bool = False, **endpoint_kwargs):
        """``directory``: where decode replicas list their KV endpoints; the links to them are
        warmed as they appear (``kvtransfer.directory``). ``push_at_step_end``: see the
        module's docstring."""
        self.publisher = TokenPublisher(replica_id() or None)
        self.aengine = AsyncEngine(config, on_outputs=self._outputs,
                                   on_error=self.publisher.fail_all)
        self.endpoint = endpoint_for(self.aengine.engine.kv_cache_spec(), backend, polled=True,
                                     **endpoint_kwargs)
        self.push_at_step_end = push_at_step_end
        self.aengine.add_ticker(lambda: self.endpoint.poll(settle=push_at_step_end))
        self.metrics = self.transfers = None
        self.replica = replica_id()
        if self.replica:  # a Serve replica: its own series, through Ray's metrics system
            self.metrics = EngineMetrics(self.aengine.feed, self.aengine.info, extra=lambda: {
                "kv_blocks_held_by_transfers": self.endpoint.held_blocks}).start()
            self.transfers = TransferMetrics("sent")
        # Whole requests, while no decode replica answers the ingress (it calls generate).
        self.whole = StreamedRequests(self.aengine, self.publisher,
                                      Placement(LOCAL, "decode_down"), self.replica,
                                      PlacementMetrics() if self.replica else None)
        # Hand-overs a decode replica sends ahead of their calls (``router.early_start``). Their
        # frames are not held: the first token may go ahead (it writes nothing), the answer
        # follows the push, which waits for the call's claim.
        self.whole.early.runners[PrefillRequest] = (self._start_early, False)
        self.warmer = (LinkWarmer(self.endpoint, directory, self.aengine.submit,
                                  on_mismatch=self._count_mismatch).start()
                       if directory is not None else None)

    def close(self) -> None:
        """At shutdown (Serve calls the deployment's ``__del__`` once it has drained): stop the
        engine thread, then fail every transfer still pending, so blocks and leases on both
        sides are released now rather than at their deadlines."""
        if self.warmer is not None:
            self.warmer.stop()
        if self.metrics is not None:
            self.metrics.stop()
        self.aengine.shutdown()
        self.endpoint.close()

    def _outputs(self, outputs) -> None:  # engine thread: streamed tokens, prefills' waiters
        # The tokens first: a hand-over's first token is then written before the event loop
        # runs the waiting prefill's next step (both are the loop's callbacks, in this order).
        self.publisher.publish(outputs)
        self.aengine.resolve_waiters(outputs)

    async def generate(self, req):
        """A whole request (``contracts.streamed``), prefilled and decoded here: the ingress
        sends requests here while no decode replica answers."""
        return await self.whole.generate(req)

    def _count_mismatch(self, _peer: EndpointInfo) -> None:
        self._count(None, "LayoutMismatchError")

    def info(self) -> EndpointInfo:
        return self.endpoint.info()

    def kv_load(self) -> dict:
        return {**load_report(self.aengine, self.endpoint),
                "links": self.warmer.summary() if self.warmer is not None else {}}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prefill the prompt (its first token sampled, its blocks held), push the blocks the
        decode replica lacks, then answer with the first token and the push's stats: on the
        decode replica's sink (``req.reply_to``) as soon as the push has ended, if this replica
        is connected to it already, and as the call's return. A hand-over the decode replica
        sent ahead of this call is claimed and followed instead."""
        rid = req.request_id
        early = self.whole.early.claim(rid)
        if early is not None:
            task, claimed = early
            if not claimed.done():
                claimed.set_result(req)  # its push may start, into the blocks this call names
            return await task  # cancelling this call cancels the hand-over, as below
        self.whole.early.remember(rid)
        route = None
        conn = self.publisher.connection(req.reply_to) if req.reply_to is not None else None
        if conn is not None:
            route = self.publisher.route(rid, conn)
            route.done.add_done_callback(retrieved)  # nobody awaits it: the answer is sent
        return await self._prefill(req, route)

    def _start_early(self, req: PrefillRequest, route):
        """A hand-over sent ahead of its call (:class:`~contracts.streamed.EarlyStarts`): its
        prompt is computed at once; its push waits for the call's claim (the state), so only
        the replica the call chose ever writes into the lease."""
        route.done.add_done_callback(retrieved)
        claimed = asyncio.get_running_loop().create_future()
        return self._prefill(req, route, claimed), claimed

    async def _prefill(self, req: PrefillRequest, route, claimed: asyncio.Future | None = None
                       ) -> PrefillResult:
        rid = req.request_id
        received, t0 = time.time(), time.perf_counter()
        try:
            try:  # no transport to this receiver, or another KV layout: refuse before any work
                self.endpoint.choose(req.peer)
                self.endpoint.plan(req.peer)
            except TransferError as exc:
                self._count(None, type(exc).__name__)
                raise
            if req.dest.expired():  # (a call queued past its deadline: the receiver has moved
                self._count(None, "not_started")  # on, so the prompt is not computed for it)
                raise PushNotStarted(f"push of {rid} failed: deadline passed before the push "
                                     "started")
            push = _Push(self, req)
            timing = PrefillTiming(received=received, replica=self.replica)
            first = await self._first_token(req, rid, received, push, timing,
                                            at_step_end=claimed is None)
            prefill_s = time.perf_counter() - t0
            timing.prefilled = time.time()
            timing.sampled = route.first_at if route is not None else 0.0
            if claimed is not None:  # the call's request names the blocks to fill
                push.req = req = await self._claimed(claimed, rid, push)
            transfer = await push.result()
            timing.pushed = time.time()
            st = transfer.stats
            TIMELINE.info("request %s prefill: push %s, %d prompt tokens (%d cached), %d blocks "
                          "(%d B) over %s; %s", rid, transfer.state.name.lower(),
                          len(req.prompt_token_ids), first.num_cached_tokens, st.blocks_sent,
                          st.bytes, st.backend, timeline(received=received,
                                                         prefilled=timing.prefilled,
                                                         pushed=timing.pushed))
            if transfer.state is not TransferState.DONE:
                failed = "not_started" if transfer.handle is None else "failed"
                self._count(None, failed)
                # Nothing written (never started): the decode replica can prefill it itself.
                raise (PushNotStarted if transfer.handle is None else TransferError)(
                    f"push of {rid} failed: {transfer.error}")
            self._count(st)
            result = _result(rid, req.prompt_token_ids, first, prefill_s, timing, st)
            if route is not None:  # the answer, ahead of the call's return
                self.publisher.end(route, rid, result.to_wire())
            return result
        finally:
            if route is not None:
                self.publisher.unroute(rid)

    async def _claimed(self, claimed: asyncio.Future, rid: str, push: "_Push"
                       ) -> PrefillRequest:
        """An early hand-over, prefilled: wait for its call, whose request it returns (a
        hand-over sent ahead of the decode replica's reservation names its blocks only there).
        Withdrawn (the call went to another replica, or none follows) or never claimed, it is
        cancelled here: its held blocks go back, unpushed."""
        try:
            return await claimed
        except BaseException:
            if self.aengine.error is None:
                self.aengine.submit(lambda e: push.started or e.release_held_blocks(rid))
            raise

    async def first_token(self, req: FirstTokenRequest) -> PrefillResult:
        """The prompt's first token alone (a decode replica with no room for the prompt yet
        publishes it at once and computes the prompt itself once room frees): prefilled in the
        engine's batch like any prompt, nothing held or pushed; its full blocks stay prefix-cache
        hits here (and in the host tier) for the next turn."""
        rid = req.request_id
        received, t0 = time.time(), time.perf_counter()
        params = req.params.model_copy(update={"max_tokens": 1})
        first = await self.aengine.run(list(req.prompt_token_ids), params, rid)
        timing = PrefillTiming(received=received, prefilled=time.time(), replica=self.replica)
        TIMELINE.info("request %s first token: %d prompt tokens (%d cached); %s", rid,
                      len(req.prompt_token_ids), first.num_cached_tokens,
                      timeline(received=received, prefilled=timing.prefilled))
        return _result(rid, req.prompt_token_ids, first, time.perf_counter() - t0, timing)

    async def _first_token(self, req: PrefillRequest, rid: str, received: float, push: "_Push",
                           timing: PrefillTiming, at_step_end: bool = True):
        """The request through the engine's batch, stopped after its first token with its blocks
        held for the push (started there with ``push_at_step_end``, unless ``at_step_end`` is
        off: an early hand-over's push waits for its call)."""
        params = req.params.model_copy(update={"max_tokens": 1})
        then = push.start if self.push_at_step_end and at_step_end else None
        try:
            return await self.aengine.run(list(req.prompt_token_ids), params, rid,
                                          hold_blocks=True, then=then,
                                          added=lambda: setattr(timing, "added", time.time()))
        except BaseException as exc:  # it may have finished, blocks held, just before the cancel
            if self.aengine.error is None:  # on the engine thread, after any push.start
                self.aengine.submit(lambda e: push.started or e.release_held_blocks(rid))
            TIMELINE.info("request %s prefill: %s before its KV was pushed; %s", rid,
                          type(exc).__name__, timeline(received=received, ended=time.time()))
            raise

    def _count(self, stats, failure: str | None = None) -> None:
        if self.transfers is None:
            return
        if failure is not None:
            self.transfers.failed(failure)
        else:
            self.transfers.record(stats)


def _result(rid: str, prompt, first, prefill_s: float, timing: PrefillTiming,
            stats=None) -> PrefillResult:
    """The answer from the engine's output of the prompt's first token."""
    return PrefillResult(
        request_id=rid, first_token=first.new_token_ids[0],
        first_logprob=first.new_logprobs[0] if first.new_logprobs else None,
        num_prompt_tokens=len(prompt), num_cached_tokens=first.num_cached_tokens,
        stats=stats, prefill_seconds=prefill_s, timing=timing,
        first_top_logprobs=first.new_top_logprobs[0] if first.new_top_logprobs else None)


class _Push:
    """One request's push of its held blocks: started on the engine thread (as the prefilling
    step returns, or as a command after it), its blocks released once it has ended, whatever
    happens to the caller."""

    def __init__(self, server: PrefillServer, req: PrefillRequest):
        self.server, self.req = server, req
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future = self.loop.create_future()
        self.started = False  # read and written on the engine thread only

    def start(self, engine, _output=None):
        """Engine thread: push the held blocks the receiver lacks."""
        rid = self.req.dest.request_id
        self.started = True
        try:
            return self.server.endpoint.push(self.req.peer, self.req.dest,
                                             engine.held_blocks(rid), self._finished)
        except Exception:
            engine.release_held_blocks(rid)
            raise

    def _finished(self, transfer) -> None:  # engine thread, once
        self.server.aengine.engine.release_held_blocks(self.req.dest.request_id)
        self.loop.call_soon_threadsafe(set_result_once, self.done, transfer)

    async def result(self):
        """The transfer once it has ended. Shielded: once asked for, the push runs even if this
        caller is cancelled, so the held blocks are always released by ``_finished`` (or by the
        push's own failure path)."""
        if not self.started:  # safe to read: the request's end was seen before this runs
            await asyncio.shield(asyncio.wrap_future(self.server.aengine.submit(self.start)))
        return await self.done
