"""A request's state inside the engine: tokens, KV blocks, progress and finish reason.

Lifecycle: WAITING → RUNNING ⇄ (preempted back to) WAITING → FINISHED. ``num_computed_tokens``
counts the tokens whose KV is in the sequence's blocks; the scheduler advances it by the chunk it
schedules, and the sequence samples once it reaches ``num_tokens``.

With the engine one step ahead (``async_scheduling``), the last ``num_pending`` entries of
``token_ids`` are :data:`PENDING`: tokens sampled by a step still running on the device. They
count as tokens for scheduling (the next step feeds them from device memory), never for outputs,
stop checks or prefix-cache hashes.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"  # decode role: blocks reserved, KV being pushed by a prefill
    LOADING = "loading"  # blocks taken, the host tier's copies into them still landing
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


_ids = itertools.count()
PENDING = -1  # a sampled token not yet copied back from the device


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_computed_tokens: int = 0
    num_present_tokens: int = 0  # tokens whose KV was already in the cache (not to be stored)
    num_cached_tokens: int = 0  # prefix-cache hit of the last admission, for stats
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    kv_load: int | None = None  # the host tier's copy in its blocks wait for (engine.kv_offload)
    draft_token_ids: list[int] = field(default_factory=list)  # proposals this step verifies
    # draft_model, proposals left on the device: where each proposal's value is in the draft's
    # token tensor (``draft_token_ids`` holds placeholders until the verification reads them)
    draft_rows: list[int] | None = None
    # draft_model speculation: leading tokens whose KV the draft holds in its cache (valid up
    # to num_computed_tokens: the draft's KV past the target's was for rejected proposals)
    num_draft_computed: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    hold_blocks: bool = False  # prefill role: keep the KV blocks after finishing, for a push
    num_pending: int = 0  # trailing PENDING entries of ``token_ids``
    pending_row: int = -1  # row of the newest pending token in its step's sampled tokens
    arrival_order: int = field(default_factory=lambda: next(_ids))
    matcher: object | None = None  # structured output: the grammar's state (engine.structured)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first taken into the batch (or given blocks to fill)
    admitted_time: float | None = None  # last joined the running batch (after a preemption too)
    # params.prompt_logprobs: per prompt position, (logprob, [[id, logprob], ...]) of its token
    # given the ones before (None at position 0 and until computed); sent with the first output
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens whose ids are known on the host (all but the pending ones)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """Generated token ids known on the host."""
        return self.token_ids[self.num_prompt_tokens:self.num_resolved_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    def add_pending(self, row: int) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1
        self.pending_row = row

    def resolve_pending(self, token: int) -> None:
        """The oldest pending token arrived from the device."""
        self.token_ids[self.num_resolved_tokens] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        if self.num_pending:
            del self.token_ids[self.num_resolved_tokens:]
            self.num_pending = 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV progress, keep the tokens."""
        self.block_ids = []
        self.draft_token_ids = []
        self.draft_rows = None
        self.num_draft_computed = 0
        self.num_computed_tokens = 0
        self.num_present_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
