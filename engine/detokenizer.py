"""Incremental detokenization with stop strings: text in one place, for the offline API and the
serving ingress alike (the engine itself never decodes text).

Each new token decodes a short window only: the tokens from where the previous piece of text
began (``prefix_offset``) to the end, minus that window's already-known head (the offset method
of vLLM's detokenizer). A window whose text ends in an incomplete UTF-8 character waits for the
next token. Joined, the pieces equal a full decode of the ids (checked by the tests for the
byte-level BPE tokenizers that Qwen3 uses). Stop strings are searched in the new text and the
short tail before it; :meth:`IncrementalDetokenizer.take` holds back text that could still turn
into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"


def decoder_of(tokenizer) -> Callable[[list[int]], str]:
    """The fastest exact ``ids -> text`` of a tokenizer (special tokens skipped): its Rust
    backend, unless the tokenizer cleans up spaces after decoding (then its own ``decode``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """The text of a growing list of output tokens.

    ``add(token)`` → True when a stop string completed (``text`` is then cut before it and
    ``stop_reason`` names it); ``take()`` → new text that is safe to send; ``finish()`` → the
    request ended: what was held back (an incomplete character, the stop-string margin) joins
    the text, and the next ``take()`` returns it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None, min_tokens: int = 0):
        """``min_tokens``: stop strings are looked for once that many tokens are in (as vLLM
        does), in the text from then on."""
        self._decode = decode or decoder_of(tokenizer)
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens whose text is in ``text``
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.text = ""
        self._sent = 0  # characters handed out by take()
        self.stop_reason: str | None = None
        self.finished = False

    def add(self, token: int) -> bool:
        if self.finished:
            return self.stop_reason is not None
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix_offset:])
        if window.endswith(_INCOMPLETE):
            return False
        self._append(window[len(self._prefix_text):])
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset])
        return self.stop_reason is not None

    def _append(self, new: str) -> None:
        if not new:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += new
        if len(self.ids) < self.min_tokens:
            return
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            cut, self.stop_reason = min(hits)
            self.text = self.text[:cut]
            self.finished = True

    def take(self) -> str:
        """Text not sent yet that can no longer become part of a stop string."""
        safe = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        piece, self._sent = self.text[self._sent:safe], safe
        return piece

    def finish(self) -> None:
        """End of the request: a trailing incomplete character is decoded (as the replacement
        character, as a full decode would) and nothing is held back any more."""
        if not self.finished:
            if self._read_offset < len(self.ids):
                window = self._decode(self.ids[self._prefix_offset:])
                self._append(window[len(self._prefix_text):])
            self.finished = True
