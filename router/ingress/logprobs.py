"""OpenAI's logprobs objects from the engine's per-token logprobs.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (``top_logprobs``
one ``{token text: logprob}`` per token, or None when not asked); chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token's text is the
token decoded alone (a piece of a multi-byte character shows as U+FFFD, as in vLLM); a logprob
of minus infinity is sent as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

import math
from functools import lru_cache

FLOOR = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


class TokenTexts:
    """Each token id's text, decoded once."""

    def __init__(self, tokenizer):
        self._text = lru_cache(maxsize=1 << 16)(
            (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: f"<{i}>"))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)

    def completion(self, token_ids, logprobs, top, offset: int = 0) -> tuple[dict, int]:
        """The completions object of some tokens whose text starts at ``offset`` in the choice's
        text → (object, the offset after them)."""
        tokens = [self(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        tops = None
        if top is not None:  # best first; two ids of one text keep the better logprob
            tops = []
            for alts in top:
                entry: dict[str, float] = {}
                for t, lp in alts:
                    entry.setdefault(self(t), _finite(lp))
                tops.append(entry)
        return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in logprobs],
                "top_logprobs": tops, "text_offset": offsets}, offset

    def echoed(self, prompt_ids, prompt_logprobs, top: bool) -> tuple[dict, int]:
        """The completions object of an echoed prompt (``echo`` with ``logprobs``): the first
        token has no logprob (None), each other the engine's prompt logprob and, with ``top``,
        its alternatives → (object, the offset after the prompt's text)."""
        rest = prompt_logprobs[1:]
        obj, offset = self.completion(
            prompt_ids[1:], [lp for lp, _ in rest], [alts for _, alts in rest] if top else None,
            len(self(prompt_ids[0])))
        first = self(prompt_ids[0])
        return {"tokens": [first] + obj["tokens"], "token_logprobs": [None] + obj["token_logprobs"],
                "top_logprobs": [None] + obj["top_logprobs"] if top else None,
                "text_offset": [0] + obj["text_offset"]}, offset

    def prompt_field(self, prompt_ids, prompt_logprobs) -> list:
        """vLLM's ``prompt_logprobs`` of a choice: None for the first token, then per token
        ``{id: {"logprob", "decoded_token"}}`` of the prompt's token and its alternatives."""
        out: list = [None]
        for token, (lp, alts) in zip(prompt_ids[1:], prompt_logprobs[1:]):
            entry = {str(token): {"logprob": _finite(lp), "decoded_token": self(token)}}
            for t, alt in alts:
                entry.setdefault(str(t), {"logprob": _finite(alt), "decoded_token": self(t)})
            out.append(entry)
        return out

    def chat(self, token_ids, logprobs, top) -> dict:
        content = []
        for i, (token, lp) in enumerate(zip(token_ids, logprobs)):
            entry = self._entry(token, lp)
            entry["top_logprobs"] = [self._entry(t, alt) for t, alt in top[i]] \
                if top is not None else []
            content.append(entry)
        return {"content": content}

    def _entry(self, token: int, lp: float) -> dict:
        text = self(token)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}
