"""What the ingress, decode and prefill roles say to each other: the typed messages of their Serve
calls (:mod:`contracts.messages`) and the token channel that carries every step's new tokens
from a decode replica to an ingress replica (:mod:`contracts.token_channel`)."""

from contracts.messages import (DecodeTiming, GenerateRequest, GenerateResult, PrefillRequest,
                                PrefillResult, StreamAddress, TokenDelta)
from contracts.token_channel import TokenChannelLost, TokenPublisher, TokenSink

__all__ = ["DecodeTiming", "GenerateRequest", "GenerateResult", "PrefillRequest", "PrefillResult",
           "StreamAddress", "TokenChannelLost", "TokenDelta", "TokenPublisher", "TokenSink"]
