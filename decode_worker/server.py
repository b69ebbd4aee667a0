"""The decode deployment: reserves KV blocks, has a prefill replica fill them, decodes, streams.

Queues per request: reserve blocks (local prefix hits are kept, not asked for) → lease them to
the endpoint → call a prefill replica with the destination → the KV lands → admit into the
running batch with the prefill's first token → stream outputs. In colocated mode (or when the
prompt is short, or blocks cannot be reserved right now) the request is prefilled here.
A consumer that goes away aborts the request on both sides and frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine import RequestOutput, SamplingParams
from engine.async_engine import AsyncEngine
from kvtransfer import KVDestination, TransferError, TransferState, endpoint_for
from prefill_worker.server import PrefillRequest


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class TokenDelta:
    """One streamed step of a request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None  # final text (stop strings cut), on the last delta
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    transfer: dict | None = None  # bytes, blocks sent/skipped, seconds (disaggregated only)


class DecodeServer:
    """Engine in the decode role; ``prefill`` is the prefill deployment's handle (or None for
    colocated mode)."""

    def __init__(self, config, backend: str, prefill=None, transfer_timeout_s: float = 30.0,
                 min_remote_prefill_tokens: int = 1):
        self.aengine = AsyncEngine(config)
        self.prefill = prefill
        self.timeout_s = transfer_timeout_s
        self.min_remote_tokens = min_remote_prefill_tokens
        self.endpoint = None
        if prefill is not None:
            self.endpoint = endpoint_for(self.aengine.engine, backend)
            self.aengine.add_ticker(self.endpoint.poll)

    @property
    def held_blocks(self) -> int:
        return self.endpoint.held_blocks if self.endpoint is not None else 0

    def kv_load(self) -> dict:
        pool = self.aengine.engine.pool
        return {"used_blocks": pool.num_used_blocks, "free_blocks": pool.num_free_blocks,
                "held_blocks": self.held_blocks, "hit_rate": pool.hit_rate}

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        prompt = list(req.prompt_token_ids)
        remote = self.prefill is not None and len(prompt) >= self.min_remote_tokens
        q = self.aengine.open_stream(req.request_id)
        transfer = None
        try:
            if remote:
                transfer = await self._remote_prefill(req, prompt)
            if transfer is None:  # colocated, or nothing reserved: prefill here
                await self.aengine.call(lambda e: e.add_request(prompt, req.params,
                                                                req.request_id))
        except BaseException:
            self.aengine.close_stream(req.request_id)
            raise
        sent = 0
        async for out in self.aengine.stream(req.request_id, q):
            yield _delta(out, sent, len(prompt), transfer)
            sent = len(out.token_ids)

    async def _remote_prefill(self, req: GenerateRequest, prompt: list[int]) -> dict | None:
        """Reserve, have a prefill replica push, admit. None when no blocks could be reserved."""
        rid = req.request_id
        reserved = await self.aengine.call(lambda e: e.reserve(prompt, req.params, rid))
        if reserved is None:
            return None
        _, blocks, present = reserved
        loop = asyncio.get_running_loop()
        landed: asyncio.Future = loop.create_future()
        dest = KVDestination(request_id=rid, endpoint_id=self.endpoint.endpoint_id,
                             block_ids=tuple(blocks), num_present_tokens=present,
                             deadline=time.time() + self.timeout_s)

        def on_finish(t):  # engine thread, once
            if t.state is TransferState.FAILED:
                self.aengine.engine.abort_request(rid)
            loop.call_soon_threadsafe(landed.set_result, t)

        def expect(engine):
            return self.endpoint.expect(dest, on_finish)

        await self.aengine.call(expect)
        try:
            result = await self.prefill.prefill.remote(
                PrefillRequest(tuple(prompt), req.params, dest, self.endpoint.info()))
        except BaseException:
            await self.aengine.call(lambda e: self._abort_transfer(dest))
            raise
        if not self.endpoint.backend.native_notify:
            await self.aengine.call(lambda e: self.endpoint.mark_landed(dest.transfer_id))
        t = await landed
        if t.state is not TransferState.DONE:
            raise TransferError(f"KV of {rid} did not land: {t.error}")
        # Publish on the engine thread, so the first token precedes every later step's.
        await self.aengine.call(lambda e: self.aengine.publish(
            e.admit(rid, result.first_token, result.first_logprob)))
        stats = result.stats
        return {"bytes": stats.bytes, "blocks_sent": stats.blocks_sent,
                "blocks_skipped": stats.blocks_skipped, "seconds": stats.seconds,
                "backend": stats.backend, "prefill_seconds": result.prefill_seconds}

    def _abort_transfer(self, dest: KVDestination) -> None:
        self.endpoint.abort(dest.transfer_id, "prefill failed")  # releases via on_finish
        self.aengine.engine.abort_request(dest.request_id)


def _delta(out: RequestOutput, sent: int, num_prompt: int, transfer: dict | None) -> TokenDelta:
    return TokenDelta(
        request_id=out.request_id, token_ids=out.token_ids[sent:],
        logprobs=out.logprobs[sent:] if out.logprobs is not None else None,
        finished=out.finished, finish_reason=out.finish_reason, text=out.text,
        num_prompt_tokens=num_prompt, num_output_tokens=len(out.token_ids),
        num_cached_tokens=out.num_cached_tokens, transfer=transfer if out.finished else None)
