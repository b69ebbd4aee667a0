"""Structured outputs: a grammar that every sampled token must keep the output inside (xgrammar).

A request's :class:`StructuredOutput` (JSON of a schema, any JSON, a regex, one of some
strings, or an EBNF grammar) is compiled once per engine (:class:`Grammars`, cached by spec)
and gets a matcher per sequence. Before each draw the matcher fills the row's token bitmask on
the host; the bitmask goes to the device and sets every disallowed logit to minus infinity
(:func:`apply_bitmasks`), before any other change to the logits. Each resolved token advances
the matcher; once the grammar is complete only an end-of-sequence token is allowed, and the
sequence ends with ``stop``.

The matcher needs the previous token before it can mask the next one, so a sequence with a
grammar is not scheduled while its newest token is still on the device (the engine runs one
step ahead): such a sequence makes a token every other step, the rest of the batch is not
slowed. A request resumed elsewhere with its tokens so far in the prompt (migration) replays
them through its matcher first (``num_resumed_tokens``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from engine.errors import BadRequest

if TYPE_CHECKING:
    import torch

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class StructuredOutput(BaseModel):
    """``kind`` and its ``spec``: a JSON schema (as JSON text), nothing (any JSON object), a
    regex, a JSON list of strings, or an EBNF grammar (xgrammar's, llama.cpp's form).
    ``compact``: JSON without whitespace between tokens (vLLM's ``disable_any_whitespace``),
    so a model that favours whitespace cannot pad its output until ``max_tokens``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    spec: str = ""
    compact: bool = False

    @classmethod
    def choice(cls, options: Iterable[str]) -> "StructuredOutput":
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise BadRequest("guided_choice: give a list of non-empty strings")
        return cls(kind="choice", spec=json.dumps(options))

    @classmethod
    def schema(cls, schema: dict | str) -> "StructuredOutput":
        return cls(kind="json_schema", spec=schema if isinstance(schema, str)
                   else json.dumps(schema, sort_keys=True))


_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")


def xgrammar_message(exc: BaseException) -> str:
    """An xgrammar error's first line without its C++ source location."""
    return _XGR_PREFIX.sub("", str(exc).strip().splitlines()[0])


class Grammars:
    """Compiles a model's structured outputs (cached) and makes their matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.compile = lru_cache(maxsize=256)(self._compile)

    def _compile(self, so: StructuredOutput):
        c = self.compiler
        try:
            if so.kind == "json_schema":
                json.loads(so.spec)
                return c.compile_json_schema(so.spec, strict_mode=True,
                                             any_whitespace=not so.compact)
            if so.kind == "json_object":  # an object (OpenAI's JSON mode), any members
                return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                             any_whitespace=not so.compact)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                options = json.loads(so.spec)
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
            return c.compile_grammar(so.spec)
        except (RuntimeError, ValueError) as exc:
            raise BadRequest(f"{_FIELDS[so.kind]}: {xgrammar_message(exc)}") from None

    def matcher(self, so: StructuredOutput, replay: Iterable[int] = ()):
        """A new sequence's matcher, advanced through ``replay`` (tokens it already made)."""
        m = self._xgr.GrammarMatcher(self.compile(so))
        for token in replay:
            if not m.accept_token(token):
                raise BadRequest(f"{_FIELDS[so.kind]}: the resumed tokens do not follow it")
        return m

    def bitmasks(self, num_rows: int, matchers: dict[int, object]) -> torch.Tensor:
        """Host int32 ``[num_rows, words]``: the allowed next tokens of each row that has a
        matcher (the other rows are left allowing everything, and are not applied)."""
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        for row, m in matchers.items():
            m.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def verify_bitmasks(self, num_rows: int, entries) -> tuple[list[int], torch.Tensor]:
        """Host bitmasks of a step that verifies proposals (engine.spec_decode.verify):
        ``entries`` are ``(first row, matcher, proposals)``; a sequence's first row allows what
        its grammar allows now, each next row what it allows after the proposals before it.
        Rows after a proposal the grammar refuses (which the mask of its own row rejects) or
        ends on are left out. Each matcher is rolled back where it was. Returns the rows the
        bitmask applies to and the bitmask."""
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        rows = []
        for row, m, proposals in entries:
            m.fill_next_token_bitmask(bitmask, row)
            rows.append(row)
            taken = 0
            for token in proposals:
                if not m.accept_token(token):
                    break
                taken += 1
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(bitmask, row + taken)
                rows.append(row + taken)
            if taken:
                m.rollback(taken)
        return rows, bitmask


_FIELDS = {"json_schema": "response_format.json_schema", "json_object": "response_format",
           "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


def apply_bitmasks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of ``rows`` to minus infinity, in place, on the logits' device."""
    import torch
    import xgrammar as xgr

    from engine.uploads import upload
    xgr.apply_token_bitmask_inplace(logits, upload(bitmask, torch.int32, logits.device),
                                    indices=rows)
