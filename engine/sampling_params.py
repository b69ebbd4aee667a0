"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator


class SamplingParams(BaseModel):
    """What to sample and when to stop.

    ``temperature == 0`` is greedy. ``top_k = -1`` (or 0) disables top-k; ``top_p = 1`` disables
    top-p. A ``seed`` gives the request its own random stream: the same seed gives the same
    tokens whatever else is in the batch. Stop strings are cut from the returned text.
    Invalid values raise ``ValueError`` naming the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            # pydantic's ValidationError is a ValueError already; re-raise with a flat message.
            raise ValueError(_flatten(exc)) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, v):
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return tuple(v)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_tuple(cls, v):
        return () if v is None else tuple(v)

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 signed bits, got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _flatten(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "").removeprefix("Value error, ")
        parts.append(f"{field}: {msg}" if field and field not in msg else msg)
    return "; ".join(parts)
