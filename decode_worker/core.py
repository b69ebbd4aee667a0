"""The decode role without Ray: reserve destination blocks, let a prefill engine push into them,
then decode.

Queues: ``begin`` reserves blocks (local prefix hits are not asked for) and leases them to the
endpoint → the prefill side pushes → ``complete`` waits for the data to land and admits the
sequence into the running batch with the prefill's first token → ``step`` decodes. A transfer
that fails, expires or is aborted releases its blocks (the request is aborted).
"""

from __future__ import annotations

import time

from contracts.messages import PrefillResult
from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from kvtransfer import (EndpointInfo, KVDestination, Transfer, TransferError, TransferState,
                        endpoint_for)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0


class DecodeCore:
    def __init__(self, config: EngineConfig, backend: str = "local", **endpoint_kwargs):
        self.engine = LLMEngine(config)
        self.endpoint = endpoint_for(self.engine, backend, **endpoint_kwargs)
        self._transfers: dict[str, Transfer] = {}

    def info(self) -> EndpointInfo:
        return self.endpoint.info()

    @property
    def held_blocks(self) -> int:
        """Blocks leased to in-flight transfers."""
        return self.endpoint.held_blocks

    def begin(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
              timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> KVDestination | None:
        """Reserve blocks for ``prompt``; None when the cache is full right now."""
        reserved = self.engine.reserve(prompt, params, request_id)
        if reserved is None:
            return None
        rid, blocks, present = reserved
        dest = KVDestination(request_id=rid, endpoint_id=self.endpoint.endpoint_id,
                             block_ids=tuple(blocks), num_present_tokens=present,
                             deadline=time.time() + timeout_s)
        self._transfers[rid] = self.endpoint.expect(dest, on_finish=self._on_transfer_finished)
        return dest

    def _on_transfer_finished(self, t: Transfer) -> None:
        if t.state is TransferState.FAILED:
            self.engine.abort_request(t.transfer_id.split("/", 1)[1])

    def complete(self, result: PrefillResult) -> RequestOutput:
        """Wait for the KV to land, then admit the request with the prefill's first token."""
        t = self._transfers.pop(result.request_id)
        if not self.endpoint.backend.native_notify:
            self.endpoint.mark_landed(t.transfer_id)
        if self.endpoint.wait(t) is not TransferState.DONE:
            raise TransferError(f"KV of {result.request_id} did not land: {t.error}")
        return self.engine.admit(result.request_id, result.first_token, result.first_logprob)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        t = self._transfers.pop(request_id, None)
        if t is not None:
            self.endpoint.abort(t.transfer_id, reason)  # releases the blocks via the callback
        self.engine.abort_request(request_id)

    def poll(self) -> None:
        self.endpoint.poll()

    def close(self) -> None:
        self.endpoint.close()
