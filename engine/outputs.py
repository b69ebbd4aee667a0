"""What the engine hands back for a request, and what the offline API returns.

The engine emits :class:`RequestOutput` deltas: each carries only the tokens its step produced,
so the cost of an output never grows with the request's length. :class:`OutputCollector` folds
deltas into a :class:`Completion` (every token, the text, stop strings applied) for callers that
want whole results: the offline :class:`~engine.llm.LLM` and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


TopLogprobs: TypeAlias = list[tuple[int, float]]  # a token's most likely (id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """A request's step: the tokens (and logprobs) that step produced, and whether it ended.
    ``num_output_tokens`` counts every output token so far, these included. ``new_top_logprobs``
    (with ``logprobs`` > 0): each new token's top ``logprobs`` alternatives."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    new_top_logprobs: list[TopLogprobs] | None = None
    # With the first output of a request asking for them: per prompt position, None (the first)
    # or ``[logprob, [[id, logprob], ...]]`` of the prompt's token there given those before
    prompt_logprobs: list | None = None


@dataclass
class Completion:
    """A finished request: every output token, its text (stop string cut) and why it ended."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # as RequestOutput's

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(self.logprobs) if self.logprobs is not None else None


def append_tokens(out, detok: IncrementalDetokenizer | None, token_ids, logprobs,
                  top_logprobs) -> bool:
    """One sequence's new tokens onto ``out`` (anything with ``token_ids``, ``logprobs`` and
    ``top_logprobs`` lists, the latter two None when not asked for), fed to its detokenizer: True
    as soon as a stop string appears (the tokens after it are dropped). The offline collector and
    the ingress's streams both follow a sequence with it."""
    for i, token in enumerate(token_ids):
        out.token_ids.append(token)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append(logprobs[i])
        if out.top_logprobs is not None and top_logprobs is not None:
            out.top_logprobs.append(top_logprobs[i])
        if detok is not None and detok.add(token):
            return True
    return False


class OutputCollector:
    """Folds one request's deltas into a :class:`Completion`; with a tokenizer it also makes the
    text and applies stop strings (the engine stops on token ids only)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer=None):
        self.result = Completion(request_id, list(prompt_token_ids),
                                 logprobs=[] if params.logprobs is not None else None,
                                 top_logprobs=[] if params.logprobs else None)
        self.detok = IncrementalDetokenizer(tokenizer, params.stop,
                                            min_tokens=params.min_tokens) if tokenizer else None

    def add(self, out: RequestOutput) -> bool:
        """Take a delta; True once the request is complete (the engine finished it, or a stop
        string appeared: then the caller aborts it in the engine)."""
        r = self.result
        if out.prompt_logprobs is not None:
            r.prompt_logprobs = out.prompt_logprobs
        if r.finished:
            return True
        if append_tokens(r, self.detok, out.new_token_ids, out.new_logprobs,
                         out.new_top_logprobs):
            self._finish("stop", self.detok.stop_reason)
            return True
        r.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self._finish(out.finish_reason, out.stop_reason)
        return r.finished

    def _finish(self, reason: str | None, stop_reason) -> None:
        r = self.result
        r.finished, r.finish_reason, r.stop_reason = True, reason, stop_reason
        if self.detok is not None:
            self.detok.finish()
            r.text = self.detok.text
