"""The checks of a request that need only the model (its vocabulary, context and tokenizer), in
one place: the engine runs them on every request it is given, the ingress runs the same ones
before any replica sees a request, so both refuse the same input with the same message.

A failed check raises :class:`engine.errors.BadRequest` naming the field. What needs the
engine's own state (free KV blocks, request ids in use, a grammar compiled for its matcher) is
checked by the engine alone; the ingress learns of it from the decode replica's answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.errors import BadRequest


@dataclass(frozen=True)
class RequestChecks:
    model: str  # the name the messages give the model
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool

    def text(self, field: str = "prompt") -> None:
        """A text prompt needs a tokenizer."""
        if not self.has_tokenizer:
            raise BadRequest(f"{field}: model {self.model!r} has no tokenizer; send token ids "
                             "instead of text")

    def prompt(self, ids: list[int]) -> list[int]:
        """Token ids the model can run: not empty, in its vocabulary, room left to generate."""
        if not ids:
            raise BadRequest("prompt: must not be empty")
        # Both passes run in C when every id is a plain int (half the time of a generator over
        # a long prompt; the ingress and the engine each check every prompt on its way in).
        if set(map(type, ids)) != {int} and not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("prompt: token ids must be integers")
        self.in_vocabulary(ids, "prompt")
        if len(ids) >= self.max_model_len:
            raise BadRequest(f"prompt: {len(ids)} tokens leave no room to generate within the "
                             f"model's context of {self.max_model_len} tokens")
        return ids

    def in_vocabulary(self, ids: Iterable[int], field: str) -> None:
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"{field}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def params(self, params) -> None:
        """Token ids the parameters name are in the vocabulary; stop strings and structured
        outputs need a tokenizer."""
        self.in_vocabulary(params.token_ids_used(), "logit_bias/stop_token_ids")
        if params.stop and not self.has_tokenizer:
            raise BadRequest("stop: stop strings need a tokenizer; use stop_token_ids")
        if params.structured_output is not None and not self.has_tokenizer:
            raise BadRequest(f"structured output: model {self.model!r} has no tokenizer")

    def fits(self, num_prompt_tokens: int, params) -> None:
        """The whole request fits the context (a server refuses a huge ``max_tokens`` rather
        than run it for minutes; the offline engine stops such a request at the context's
        end with ``length``)."""
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise BadRequest(f"max_tokens: {params.max_tokens} new tokens after a "
                             f"{num_prompt_tokens}-token prompt exceed the model's context of "
                             f"{self.max_model_len} tokens")
