"""A request's state inside the engine: tokens, KV blocks, progress and finish reason.

Lifecycle: WAITING → RUNNING ⇄ (preempted back to) WAITING → FINISHED. ``num_computed_tokens``
counts the tokens whose KV is in the sequence's blocks; the scheduler advances it by the chunk it
schedules, and the sequence samples once it reaches ``num_tokens``.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"  # decode role: blocks reserved, KV being pushed by a prefill
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


_ids = itertools.count()


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
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    hold_blocks: bool = False  # prefill role: keep the KV blocks after finishing, for a push
    arrival_order: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV progress, keep the tokens."""
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_present_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
