"""The decode deployment: reserves KV blocks, has a prefill replica fill them, decodes, and sends
every engine step's tokens to the ingress over the token channel.

Queues per request: the Serve call arrives naming its ingress's token sink → dial it (once per
ingress replica) and route the request to that connection → reserve blocks (local prefix hits
are kept, not asked for) → lease them to the KV endpoint → call a prefill replica with the
destination → the KV lands → admit into the running batch with the prefill's first token → after
each engine step the publisher packs that step's tokens, one frame per ingress replica, on the
engine thread → the call returns a :class:`GenerateResult` once the request has ended. In
colocated mode, when blocks cannot be reserved right now, or when the prefill replica refuses
the call (its queue is full) or is gone, the request is prefilled here. A cancelled call aborts
the request and frees its blocks on both sides.
"""

from __future__ import annotations

import asyncio
import logging
import time

from contracts.messages import (TIMELINE, DecodeTiming, GenerateRequest, GenerateResult,
                                PrefillRequest, PrefillResult, serve_logger, timeline)
from contracts.token_channel import TokenPublisher
from engine.async_engine import AsyncEngine
from kvtransfer import KVDestination, TransferError, TransferState, endpoint_for

log = serve_logger(__name__)


def prefill_unavailable(exc: BaseException) -> bool:
    """The prefill replica refused the call (its queue is full) or is gone. Either way it wrote
    nothing into our blocks (a refused call never started; a dead writer writes no more), so the
    decode replica can release the lease and prefill the request itself at once."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, (BackPressureError, RayActorError))


class DecodeServer:
    """Engine in the decode role; ``prefill`` is the prefill deployment's handle (or None for
    colocated mode)."""

    def __init__(self, config, backend: str, prefill=None, transfer_timeout_s: float = 30.0,
                 **endpoint_kwargs):
        self.publisher = TokenPublisher()
        self.aengine = AsyncEngine(config, on_outputs=self.publisher.publish,
                                   on_error=self.publisher.fail_all)
        self.prefill = prefill
        self.timeout_s = transfer_timeout_s
        self.endpoint = None
        if prefill is not None:
            self.endpoint = endpoint_for(self.aengine.engine, backend, polled=True,
                                         **endpoint_kwargs)
            self.aengine.add_ticker(self.endpoint.poll)

    def close(self) -> None:
        """At shutdown (Serve calls the deployment's ``__del__`` once it has drained): stop the
        engine thread, then fail every transfer still pending, so blocks and leases on both
        sides are released now rather than at their deadlines."""
        self.aengine.shutdown()
        if self.endpoint is not None:
            self.endpoint.close()

    @property
    def held_blocks(self) -> int:
        return self.endpoint.held_blocks if self.endpoint is not None else 0

    def kv_load(self) -> dict:
        pool = self.aengine.engine.pool
        return {"used_blocks": pool.num_used_blocks, "free_blocks": pool.num_free_blocks,
                "held_blocks": self.held_blocks, "hit_rate": pool.hit_rate}

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        timing = DecodeTiming(received=time.time())
        rid, prompt = req.request_id, list(req.prompt_token_ids)
        route = self.publisher.route(rid, await self.publisher.connect(req.reply_to))
        prefilled: PrefillResult | None = None
        try:
            if self.prefill is not None:
                prefilled = await self._remote_prefill(req, prompt, timing)
            if prefilled is None:  # colocated, or nothing reserved: prefill here
                def add(engine):  # stamped here: the first token may come before the loop runs
                    engine.add_request(prompt, req.params, rid)
                    timing.queued = time.time()
                await self.aengine.call(add)
            last = await route.done
        except BaseException as exc:
            self.publisher.unroute(rid)
            self.aengine.abort(rid)
            timing.first_token, timing.finished = route.first_at, time.time()
            outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else \
                f"error {type(exc).__name__}"
            _log_timeline(rid, outcome, timing, prefilled, None)
            raise
        timing.first_token, timing.finished = route.first_at, time.time()
        _log_timeline(rid, last.finish_reason, timing, prefilled, last.num_output_tokens)
        return GenerateResult(
            request_id=rid, num_prompt_tokens=len(prompt),
            num_output_tokens=last.num_output_tokens, num_cached_tokens=last.num_cached_tokens,
            finish_reason=last.finish_reason,
            transfer=prefilled.stats if prefilled is not None else None,
            prefill_seconds=prefilled.prefill_seconds if prefilled is not None else 0.0,
            timing=timing)

    async def _remote_prefill(self, req: GenerateRequest, prompt: list[int],
                              timing: DecodeTiming) -> PrefillResult | None:
        """Reserve, have a prefill replica push, admit (publishing the prefill's first token).
        None when no blocks could be reserved right now."""
        rid = req.request_id
        loop = asyncio.get_running_loop()
        landed: asyncio.Future = loop.create_future()

        def on_finish(t):  # engine thread, once
            if t.state is TransferState.FAILED:
                self.aengine.engine.abort_request(rid)
            loop.call_soon_threadsafe(_resolve, landed, t)

        def reserve_and_lease(engine) -> KVDestination | None:
            """One engine command: blocks are never reserved without their lease (a cancel
            between the two would otherwise leave them to the request's abort alone)."""
            reserved = engine.reserve(prompt, req.params, rid)
            if reserved is None:
                return None
            _, blocks, present = reserved
            dest = KVDestination(request_id=rid, endpoint_id=self.endpoint.endpoint_id,
                                 block_ids=tuple(blocks), num_present_tokens=present,
                                 deadline=time.time() + self.timeout_s)
            self.endpoint.expect(dest, on_finish)
            return dest

        dest = await self.aengine.call(reserve_and_lease)
        if dest is None:
            return None
        timing.prefill_called = time.time()
        call = self.prefill.prefill.remote(
            PrefillRequest(tuple(prompt), req.params, dest, self.endpoint.info()))
        try:
            result = await _answer_or_lease_failure(call, landed)
        except BaseException as exc:
            # Releases the lease and, through on_finish, the reservation (engine thread, in
            # order: before a local prefill of the same request id is queued).
            self.aengine.submit(lambda e: self.endpoint.abort(dest.transfer_id, "prefill failed"))
            if isinstance(exc, Exception) and prefill_unavailable(exc):
                log.info("request %s: prefill replica unavailable (%s); prefilling here", rid,
                         type(exc).__name__)
                return None
            raise
        if result is None:  # the lease failed first (its deadline passed): frozen or too slow
            call.cancel()  # the lease's failure already released the reservation
            log.warning("request %s: no KV from the prefill replica by the deadline (%s); "
                        "prefilling here", rid, landed.result().error)
            return None
        timing.prefill_returned = time.time()
        if not self.endpoint.backend.native_notify:
            await self.aengine.call(lambda e: self.endpoint.mark_landed(dest.transfer_id))
        t = await landed
        if t.state is not TransferState.DONE:
            raise TransferError(f"KV of {rid} did not land: {t.error}")
        timing.queued = time.time()

        def admit(engine):  # the first token goes out before any later step's
            self.publisher.publish([engine.admit(rid, result.first_token, result.first_logprob)])

        await self.aengine.call(admit)
        return result


def _log_timeline(rid: str, outcome: str | None, timing: DecodeTiming,
                  prefilled: PrefillResult | None, tokens: int | None) -> None:
    if not TIMELINE.isEnabledFor(logging.INFO):
        return
    where = "prefilled here" if timing.queued else "not prefilled"
    if prefilled is not None:
        st = prefilled.stats
        where = (f"prefilled remotely in {prefilled.prefill_seconds * 1e3:.1f} ms, "
                 f"{st.blocks_sent} blocks ({st.bytes} B, {st.blocks_skipped} skipped) over "
                 f"{st.backend} in {st.seconds * 1e3:.1f} ms")
    made = "" if tokens is None else f", {tokens} tokens"
    TIMELINE.info("request %s decode: %s%s, %s; %s", rid, outcome, made, where,
                  timeline(received=timing.received, prefill_called=timing.prefill_called,
                           prefill_returned=timing.prefill_returned, queued=timing.queued,
                           first_token=timing.first_token, finished=timing.finished))


async def _answer_or_lease_failure(call, landed: asyncio.Future) -> PrefillResult | None:
    """The prefill call's answer, or None when the KV lease fails before it (the lease fails at
    its deadline, a little after the sender stops writing). A lease that is done first (the
    transport notified the landing) still waits for the answer, which carries the first
    token."""
    async def answer():
        return await call

    task = asyncio.ensure_future(answer())
    try:
        await asyncio.wait({task, landed}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and landed.result().state is TransferState.FAILED:
            task.cancel()
            return None
        return await task
    except BaseException:
        task.cancel()
        raise


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
