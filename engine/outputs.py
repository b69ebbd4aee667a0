"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A request's state after a step. ``new_token_ids`` are the tokens produced by that step;
    ``token_ids`` all output tokens so far. ``text`` is filled once finished (stop strings cut)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    num_cached_tokens: int = 0
