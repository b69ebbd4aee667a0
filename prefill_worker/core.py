"""The prefill role without Ray: an engine whose requests stop after the first token and whose
KV blocks are pushed to a decode engine's destination.

Queues: a request is added with ``hold_blocks`` → runs (chunked) prefill in the engine's batch →
finishes after sampling the first token, its blocks held → pushed to the destination (only the
blocks the receiver lacks) → blocks released into the prefix cache once the push is terminal.
"""

from __future__ import annotations

import time

from contracts.messages import PrefillResult
from engine import EngineConfig, LLMEngine, SamplingParams
from kvtransfer import EndpointInfo, KVDestination, TransferError, TransferState, endpoint_for


class PrefillCore:
    def __init__(self, config: EngineConfig, backend: str = "local", **endpoint_kwargs):
        self.engine = LLMEngine(config)
        self.endpoint = endpoint_for(self.engine, backend, **endpoint_kwargs)

    def info(self) -> EndpointInfo:
        return self.endpoint.info()

    def prefill(self, prompt: list[int], params: SamplingParams, dest: KVDestination,
                peer: EndpointInfo) -> PrefillResult:
        """Prefill ``prompt``, push its KV into ``dest`` and return the first token.
        Raises :class:`TransferError` when the push fails (the blocks are released either way)."""
        rid = dest.request_id
        t0 = time.perf_counter()
        self.engine.add_request(prompt, params.model_copy(update={"max_tokens": 1}), rid,
                                hold_blocks=True)
        out = None
        while out is None:
            out = next((o for o in self.engine.step() if o.request_id == rid and o.finished), None)
        prefill_s = time.perf_counter() - t0
        blocks = self.engine.held_blocks(rid)
        try:
            transfer = self.endpoint.push(peer, dest, blocks,
                                          on_finish=lambda _t: self.engine.release_held_blocks(rid))
        except Exception:
            self.engine.release_held_blocks(rid)
            raise
        if self.endpoint.wait(transfer) is not TransferState.DONE:
            raise TransferError(f"push of {rid} failed: {transfer.error}")
        return PrefillResult(
            request_id=rid, first_token=out.new_token_ids[0],
            first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
            num_prompt_tokens=len(prompt), num_cached_tokens=out.num_cached_tokens,
            stats=transfer.stats, prefill_seconds=prefill_s)

    def close(self) -> None:
        self.endpoint.close()
