"""Incremental detokenization for streaming, holding back text that may still become a stop
string or is an incomplete UTF-8 sequence."""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = 0

    def feed(self, token_ids: list[int]) -> str:
        """Text that is safe to send after these new tokens."""
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        safe = max(self.emitted, len(text) - self.hold)
        delta, self.emitted = text[self.emitted:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest, given the engine's final text (stop strings already cut)."""
        delta = final_text[self.emitted:]
        self.emitted = len(final_text)
        return delta
