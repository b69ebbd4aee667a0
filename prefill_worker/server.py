"""The prefill deployment: prompts in, KV pushed to a decode replica, first token out.

Queues: a request joins the engine's batch (chunked prefill with the others) → stops after its
first token with its blocks held → the blocks the decode side lacks are pushed → the blocks go
back to the prefix cache once the push is terminal → ``PrefillResult`` returns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from kvtransfer import (EndpointInfo, KVDestination, PrefillResult, TransferError,
                        TransferState, endpoint_for)


@dataclass(frozen=True)
class PrefillRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    dest: KVDestination
    peer: EndpointInfo  # the decode replica's endpoint


class PrefillServer:
    """Engine in the prefill role plus its KV endpoint (used by the Serve deployment)."""

    def __init__(self, config, backend: str):
        self.aengine = AsyncEngine(config)
        self.endpoint = endpoint_for(self.aengine.engine, backend)
        self.aengine.add_ticker(self.endpoint.poll)

    def info(self) -> EndpointInfo:
        return self.endpoint.info()

    def kv_load(self) -> dict:
        pool = self.aengine.engine.pool
        return {"used_blocks": pool.num_used_blocks, "free_blocks": pool.num_free_blocks}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        rid = req.dest.request_id
        t0 = time.perf_counter()
        first = None
        params = req.params.model_copy(update={"max_tokens": 1})
        async for out in self.aengine.generate(list(req.prompt_token_ids), params, rid,
                                               hold_blocks=True):
            first = out
        prefill_s = time.perf_counter() - t0
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

        await self.aengine.call(push)
        transfer = await done
        if transfer.state is not TransferState.DONE:
            raise TransferError(f"push of {rid} failed: {transfer.error}")
        return PrefillResult(
            request_id=rid, first_token=first.token_ids[0],
            first_logprob=first.logprobs[0] if first.logprobs else None,
            num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=first.num_cached_tokens,
            stats=transfer.stats, prefill_seconds=prefill_s)
