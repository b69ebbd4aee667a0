"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from engine.errors import BadRequest
from engine.structured import StructuredOutput

MAX_LOGPROBS = 20  # top_logprobs per token, as OpenAI allows
MAX_N = 128  # sequences per request (n, best_of)
SAMPLING_EPS = 1e-5  # a temperature below it is greedy (vLLM's _SAMPLING_EPS)


class SamplingParams(BaseModel):
    """What to sample and when to stop.

    ``temperature == 0`` (or below ``SAMPLING_EPS``) is greedy. ``top_k = -1`` (or 0) disables
    top-k; ``top_p = 1`` disables top-p; ``min_p = 0`` disables min-p. A ``seed`` gives the
    request its own random stream: the same seed gives the same tokens whatever else is in the
    batch. Stop strings are cut from the returned text.

    Logits are changed before sampling (greedy included), as vLLM does: ``logit_bias`` (token id
    → value added), ``min_tokens`` (EOS and ``stop_token_ids`` banned until that many tokens),
    ``repetition_penalty`` (every token of the prompt and the output: positive logits divided
    by it, negative ones multiplied), ``frequency_penalty`` (minus penalty × count in the
    output) and ``presence_penalty`` (minus penalty if in the output). Then temperature, min-p,
    top-k, top-p. ``logprobs``: None, or the number of most likely tokens to return with each
    sampled token's logprob (0: the sampled token's only); logprobs are of the model's raw
    distribution (before any of the changes above).

    ``n`` and ``best_of`` are for whoever fans a request out (:func:`fan_out`): the engine runs
    one sequence per request. Invalid values raise :class:`engine.errors.BadRequest` (a
    ``ValueError``) naming the field.
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
    logprobs: int | None = None
    # The logprob of every prompt token after the first (vLLM's ``prompt_logprobs``), with the
    # ``prompt_logprobs`` most likely tokens at each position; None: off. Such a request's
    # prompt is computed whole (no prefix-cache hit), as in vLLM.
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    # Every output token keeps the text inside this grammar (engine.structured).
    structured_output: StructuredOutput | None = None
    # Set by whoever resumes a request elsewhere with its tokens so far appended to the prompt
    # (migration): the prompt's last ``num_resumed_tokens`` are output, for the penalties.
    num_resumed_tokens: int = 0
    # Scheduling priority (vLLM's ``priority``): lower runs first; equal ones in arrival order.
    priority: int = 0

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            # pydantic's ValidationError is a ValueError already; re-raise with a flat message.
            raise BadRequest(_flatten(exc)) from None

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

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_flag(cls, v):
        if isinstance(v, bool):  # True: the sampled token's logprob only
            return 0 if v else None
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, v):
        if v is None:
            return ()
        items = v.items() if isinstance(v, dict) else v
        try:
            return tuple(sorted((int(k), float(b)) for k, b in items))
        except (TypeError, ValueError):
            raise ValueError("logit_bias: keys must be token ids (integers) and values numbers") \
                from None

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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got "
                             f"{self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], "
                                 f"got {bias}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias: a token id appears twice")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if self.num_resumed_tokens < 0:
            raise ValueError("num_resumed_tokens must be non-negative")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise ValueError(f"best_of must be in [n={self.n}, {MAX_N}], got {self.best_of}")
        return self

    @property
    def changes_logits(self) -> bool:
        """Whether anything changes the logits before sampling (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens)

    @property
    def num_sequences(self) -> int:
        """How many sequences a request with these parameters runs: ``best_of`` or ``n``."""
        return self.best_of or self.n

    def token_ids_used(self) -> list[int]:
        """Token ids named by the parameters (to check against the vocabulary)."""
        return [t for t, _ in self.logit_bias] + list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """The argmax: a temperature below ``SAMPLING_EPS`` (vLLM's ``_SAMPLING_EPS``: the
        logits over such a temperature are nothing but their argmax, or overflow) or top-k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The one-sequence parameters of each of a request's ``num_sequences`` sequences: sequence
    ``i`` of a seeded request has seed ``seed + i`` (as vLLM does), so it draws the tokens a
    single request with that seed would; ``best_of`` asks for logprobs (to rank by)."""
    k = params.num_sequences
    if k == 1 and params.best_of is None:
        return [params]
    update = {"n": 1, "best_of": None}
    if params.best_of is not None and params.logprobs is None:
        update["logprobs"] = 0
    return [params.model_copy(update={**update, "seed": None if params.seed is None
                                      else (params.seed + i + 2**63) % 2**64 - 2**63})
            for i in range(k)]


def best_indices(params: SamplingParams, cumulative_logprobs: list[float]) -> list[int]:
    """Which of a request's sequences to return, in order: all ``n``; or with ``best_of``, the
    ``n`` with the highest cumulative logprob (ties: the lower index)."""
    if params.best_of is None:
        return list(range(len(cumulative_logprobs)))
    ranked = sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])
    return ranked[:params.n]


def _flatten(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "").removeprefix("Value error, ")
        parts.append(f"{field}: {msg}" if field and field not in msg else msg)
    return "; ".join(parts)
