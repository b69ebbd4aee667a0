"""What the ingress, decode and prefill roles share: the typed messages of their Serve calls
(:mod:`contracts.messages`), the token channel that carries every step's new tokens from a decode
replica to an ingress replica over a TCP connection (:mod:`contracts.token_channel`), each
replica's metrics through Ray's (:mod:`contracts.metrics`), and the Serve methods both roles
answer (:mod:`contracts.role`)."""

from contracts.messages import (DecodeTiming, GenerateRequest, GenerateResult, PrefillRequest,
                                PrefillResult, StreamAddress, TokenDelta)
from contracts.token_channel import TokenChannelLost, TokenPublisher, TokenSink

__all__ = ["DecodeTiming", "GenerateRequest", "GenerateResult", "PrefillRequest", "PrefillResult",
           "StreamAddress", "TokenChannelLost", "TokenDelta", "TokenPublisher", "TokenSink"]
