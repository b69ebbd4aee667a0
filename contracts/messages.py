"""The typed messages between the ingress, decode replicas and prefill replicas.

Per request, over Serve calls (placement, routing, cancellation, errors):
    ingress → decode:  :class:`GenerateRequest`  (the call returns nothing; a lost replica or a
                       fault of the server comes back as the call's exception)
    decode → prefill:  :class:`PrefillRequest`   →  :class:`PrefillResult` once the KV is pushed
                       (also sent on the decode replica's own token sink, ahead of the return);
                       :class:`FirstTokenRequest` → :class:`PrefillResult` (no KV moved): a
                       decode replica with no room yet has its first token made there
Per engine step, over the token channel (:mod:`contracts.token_channel`):
    decode → ingress:  :class:`TokenDelta` of every request of that ingress, in one frame;
                       after a request's last delta, its :class:`GenerateResult` (usage,
                       transfer, timings, or the refusal of a bad request): one path back for
                       an answer, in order behind its tokens
    prefill → decode:  a hand-over's :class:`PrefillResult`, on the decode replica's own sink
The other way on a connection (``router.early_start``), a request ahead of its Serve call:
    ingress → decode:  :class:`GenerateRequest`;  decode → prefill:  :class:`PrefillRequest`
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the ingress imports these messages, never kvtransfer
    from kvtransfer import EndpointInfo, KVDestination, TransferStats


@dataclass(frozen=True)
class StreamAddress:
    """Where a decode replica sends a request's tokens: an ingress replica's token sink.
    ``key`` is that sink's secret; a publisher that does not present it is refused."""

    host: str
    port: int
    key: str
    sink_id: str


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str
    reply_to: StreamAddress


@dataclass(slots=True)
class TokenDelta:
    """A request's new tokens from one engine step (``finish_reason`` set on its last one).
    ``num_output_tokens`` counts every output token so far, these included."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    top_logprobs: list[list[list]] | None = None  # per token: [[id, logprob], ...], best first
    prompt_logprobs: list | None = None  # the first delta of a request asking (RequestOutput's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PrefillTiming:
    """When the prefill replica saw a request's milestones (``time.time()`` seconds)."""

    received: float = 0.0  # the Serve call arrived (started early: the early start did)
    added: float = 0.0  # the engine thread took the request
    sampled: float = 0.0  # its first token was published (engine thread; 0.0: no sink)
    prefilled: float = 0.0  # the event loop had the first token (the KV is complete)
    pushed: float = 0.0  # the push of its KV ended
    replica: str = ""  # the replica's id


@dataclass
class DecodeTiming:
    """When the decode replica saw a request's milestones (``time.time()`` seconds)."""

    replica: str = ""  # the replica's id
    prefill: PrefillTiming | None = None  # disaggregated: the prefill replica's own
    received: float = 0.0  # the Serve call arrived (started early: the early start did)
    claimed: float = 0.0  # started early: its Serve call reached the replica (0.0: it had ended)
    queued: float = 0.0  # handed to the engine: its prefill queued here, or its KV landed
    reserved: float = 0.0  # disaggregated: its blocks were reserved (engine thread)
    prefill_called: float = 0.0  # disaggregated: the prefill replica was called
    first_arrived: float = 0.0  # handed over: the prefill replica's first token came, ahead
    prefill_returned: float = 0.0  # disaggregated: its result came back (KV pushed)
    first_token: float = 0.0  # the first token left in a frame
    finished: float = 0.0
    # no room here yet: the first token came from a prefill replica (prefill_called/returned:
    # that call), the prompt queued here meanwhile
    first_token_by_prefill: bool = False


@dataclass
class TransferSummary:
    """One hand-over as the ingress reports it (the fields of ``kvtransfer.TransferStats``,
    without importing the transfer layer)."""

    bytes: int = 0
    blocks_sent: int = 0
    blocks_skipped: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    backend: str = ""
    src_node: str = ""
    dst_node: str = ""

    @classmethod
    def of(cls, stats: TransferStats | None) -> TransferSummary | None:
        return None if stats is None else cls(**asdict(stats))


@dataclass
class GenerateResult:
    """How a request ended on its decode replica; sent after its last tokens on the token
    channel."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str | None
    transfer: TransferSummary | None = None  # disaggregated only
    prefill_seconds: float = 0.0  # the prefill replica's time from queue to first token
    timing: DecodeTiming = field(default_factory=DecodeTiming)
    # Where the prompt was prefilled ("local": on the decode replica; "remote": by a prefill
    # replica) and why (decode_worker.placement)
    prefilled_where: str = "local"
    prefilled_why: str = "colocated"
    # Set when the request was refused as bad input only a replica can check (a prompt its KV
    # cache cannot hold, a grammar that does not compile): nothing was generated; the ingress
    # answers 400 (``BadRequest``) with this text. Sent, not raised, so the replica logs one
    # line instead of a traceback.
    error: str | None = None

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> GenerateResult:
        timing = dict(d.get("timing") or {})
        prefill = timing.pop("prefill", None)
        transfer = d.get("transfer")
        return cls(**{**d, "timing": DecodeTiming(**timing, prefill=PrefillTiming(**prefill)
                                                   if prefill else None),
                      "transfer": TransferSummary(**transfer) if transfer else None})


@dataclass(frozen=True)
class PrefillRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # Where the push writes. A hand-over sent ahead of its call may name no blocks yet (sent
    # before the decode replica's reservation): its push waits for the call, whose request's
    # ``dest`` it writes into.
    dest: KVDestination
    peer: EndpointInfo  # the decode replica's endpoint
    # The decode replica's token sink for its hand-overs: the prefill replica sends its answer
    # there as soon as the push has ended, ahead of the call's return (None: the return only)
    reply_to: StreamAddress | None = None

    @property
    def request_id(self) -> str:
        return self.dest.request_id


@dataclass(frozen=True)
class FirstTokenRequest:
    """A prompt's first token only: computed and sampled, no KV kept or pushed."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str


@dataclass
class PrefillResult:
    """What a prefill replica returns once it has pushed a request's KV (or, for a
    :class:`FirstTokenRequest`, once it has sampled the first token: ``stats`` None)."""

    request_id: str
    first_token: int
    first_logprob: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    stats: TransferStats | None = None  # set by the prefill replica (the push's own stats)
    prefill_seconds: float = 0.0
    first_top_logprobs: list[tuple[int, float]] | None = None
    timing: PrefillTiming = field(default_factory=PrefillTiming)

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> PrefillResult:
        """The answer as the token channel carried it; its push's stats as a
        :class:`TransferSummary` (the same fields, without importing the transfer layer)."""
        stats, top = d.get("stats"), d.get("first_top_logprobs")
        return cls(**{**d, "stats": TransferSummary(**stats) if stats else None,
                      "first_top_logprobs": [tuple(p) for p in top] if top is not None else None,
                      "timing": PrefillTiming(**(d.get("timing") or {}))})


# Each serving module logs under Serve's logger, so its lines land in the replica's Serve log
# (``logs/serve/replica_<app>_<deployment>_<id>.log``) with Serve's format, level and encoding
# (``logging_config`` of the deployment); ``baton.timeline`` is one line per request and role.
TIMELINE = logging.getLogger("ray.serve.baton.timeline")


def serve_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"ray.serve.{name}")


def timeline(**marks: float) -> str:
    """``name +ms`` for each milestone that happened (non-zero ``time.time()`` values), relative
    to the first one, in the given order: ``received +0.0 queued +1.3 first_token +14.2``."""
    start = next((t for t in marks.values() if t), 0.0)
    return " ".join(f"{name} +{(t - start) * 1e3:.1f}" for name, t in marks.items() if t)
