"""The prefill deployment: prompts in, KV pushed to a decode replica, first token out.

Queues: a request joins the engine's batch (chunked prefill with the others) → stops after its
first token with its blocks held → the blocks the decode side lacks are pushed → the blocks go
back to the prefix cache once the push is terminal → ``PrefillResult`` returns. A caller that goes
away before the push starts gets its held blocks released; a push once started runs to its end
(the decode side's deadline bounds it) and releases them itself.
"""

from __future__ import annotations

import asyncio
import time

from contracts.messages import (TIMELINE, PrefillRequest, PrefillResult, PrefillTiming,
                               timeline)
from contracts.metrics import EngineMetrics, TransferMetrics, replica_id
from contracts.role import load_report
from engine.async_engine import AsyncEngine
from kvtransfer import (EndpointInfo, PushNotStarted, TransferError, TransferState,
                        endpoint_for)
from kvtransfer.directory import LinkWarmer, PeerDirectory


class PrefillServer:
    """Engine in the prefill role plus its KV endpoint (used by the Serve deployment)."""

    def __init__(self, config, backend: str, directory: PeerDirectory | None = None,
                 **endpoint_kwargs):
        """``directory``: where decode replicas list their KV endpoints; the links to them are
        warmed as they appear (``kvtransfer.directory``)."""
        self.aengine = AsyncEngine(config)
        self.endpoint = endpoint_for(self.aengine.engine.kv_cache_spec(), backend, polled=True,
                                     **endpoint_kwargs)
        self.aengine.add_ticker(self.endpoint.poll)
        self.metrics = self.transfers = None
        self.replica = replica_id()
        if self.replica:  # a Serve replica: its own series, through Ray's metrics system
            self.metrics = EngineMetrics(self.aengine.feed, self.aengine.info, extra=lambda: {
                "kv_blocks_held_by_transfers": self.endpoint.held_blocks}).start()
            self.transfers = TransferMetrics("sent")
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

    def _count_mismatch(self, _peer: EndpointInfo) -> None:
        self._count(None, "LayoutMismatchError")

    def info(self) -> EndpointInfo:
        return self.endpoint.info()

    def kv_load(self) -> dict:
        return {**load_report(self.aengine, self.endpoint),
                "links": self.warmer.summary() if self.warmer is not None else {}}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prefill the prompt (its first token sampled, its blocks held), push the blocks the
        decode replica lacks, then answer with the first token and the push's stats."""
        rid = req.dest.request_id
        received, t0 = time.time(), time.perf_counter()
        try:  # no transport to this receiver, or another KV layout: refuse before any work
            self.endpoint.choose(req.peer)
            self.endpoint.plan(req.peer)
        except TransferError as exc:
            self._count(None, type(exc).__name__)
            raise
        first = await self._first_token(req, rid, received)
        prefill_s = time.perf_counter() - t0
        timing = PrefillTiming(received=received, prefilled=time.time(), replica=self.replica)
        transfer = await self._push(req, rid)
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
        return PrefillResult(
            request_id=rid, first_token=first.new_token_ids[0],
            first_logprob=first.new_logprobs[0] if first.new_logprobs else None,
            num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=first.num_cached_tokens,
            stats=st, prefill_seconds=prefill_s, timing=timing,
            first_top_logprobs=first.new_top_logprobs[0] if first.new_top_logprobs else None)

    async def _first_token(self, req: PrefillRequest, rid: str, received: float):
        """The request through the engine's batch, stopped after its first token with its blocks
        held for the push."""
        params = req.params.model_copy(update={"max_tokens": 1})
        try:
            return await self.aengine.run(list(req.prompt_token_ids), params, rid,
                                          hold_blocks=True)
        except BaseException as exc:  # it may have finished, blocks held, just before the cancel
            if self.aengine.error is None:
                self.aengine.submit(lambda e: e.release_held_blocks(rid))
            TIMELINE.info("request %s prefill: %s before its KV was pushed; %s", rid,
                          type(exc).__name__, timeline(received=received, ended=time.time()))
            raise

    async def _push(self, req: PrefillRequest, rid: str):
        """Push the held blocks the receiver lacks; the transfer once it has ended (its blocks
        are released then, whatever happens to this caller)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_finish(t):  # engine thread, once
            self.aengine.engine.release_held_blocks(rid)
            loop.call_soon_threadsafe(done.set_result, t)

        def push(engine):
            try:
                return self.endpoint.push(req.peer, req.dest, engine.held_blocks(rid), on_finish)
            except Exception:
                engine.release_held_blocks(rid)
                raise

        # Shielded: once asked for, the push runs even if this caller is cancelled, so the held
        # blocks are always released by on_finish (or by push's own failure path).
        await asyncio.shield(asyncio.wrap_future(self.aengine.submit(push)))
        return await done

    def _count(self, stats, failure: str | None = None) -> None:
        if self.transfers is None:
            return
        if failure is not None:
            self.transfers.failed(failure)
        else:
            self.transfers.record(stats)
