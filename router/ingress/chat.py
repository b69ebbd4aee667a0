"""Qwen3's chat output as OpenAI's message: reasoning apart from the answer, tool calls parsed.

Qwen3 writes its reasoning as ``<think>…</think>`` before the answer, and a tool call as
``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` (several in a row for parallel
calls). :func:`split_message` turns a whole output into ``(reasoning_content, content,
tool_calls)`` as vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser do (a call whose
JSON does not parse stays in the content). :class:`StreamSplitter` does the same on a stream:
reasoning and content go out as they come, holding back only text that could still be the start
of a marker; once a ``<tool_call>`` opens, each call goes out as vLLM's hermes parser streams it:
a first delta with its index, id and name once ``{"name": …, "arguments":`` has come, then its
arguments' JSON text as it is generated (holding back only what could be the call's closing
brace or marker). A call written in another order (``arguments`` first) goes out whole when it
closes; a first call that does not parse turns the rest into content, as in the whole text.
:func:`tool_grammar` is the grammar that
``tool_choice`` ``required`` or a named function puts on the output: one or more calls (one, for
a named function or ``parallel_tool_calls: false``) of the offered functions, each call's
arguments following its JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine.errors import BadRequest
from engine.structured import xgrammar_message

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# The head of a call whose arguments can stream: ``<tool_call> {"name": "<name>", "arguments": ``
_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)``: the text inside a leading think block (None without one)."""
    if not text.startswith(THINK_OPEN):
        return None, text
    reasoning, closed, rest = text[len(THINK_OPEN):].partition(THINK_CLOSE)
    if not closed:  # cut off while thinking: all of it is reasoning
        return reasoning.lstrip("\n") or None, ""
    return reasoning.strip("\n") or None, rest.lstrip("\n")


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """``(content before the calls, calls)``; with a call that does not parse, no calls and the
    whole text as content."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text[start:]):
        try:
            call = json.loads(body, strict=False)  # a raw control character in a string too
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments)
                                   if not isinstance(arguments, str) else arguments}})
    if not calls:
        return text, []
    return text[:start].rstrip("\n"), calls


def split_message(text: str, reasoning: bool, tools: bool) -> tuple[str | None, str, list[dict]]:
    """A whole output → ``(reasoning_content, content, tool_calls)``."""
    thought, rest = split_reasoning(text) if reasoning else (None, text)
    content, calls = parse_tool_calls(rest) if tools else (rest, [])
    return thought, content, calls


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


@dataclass
class StreamSplitter:
    """Feeds on an output's text pieces; returns ``(kind, text)`` deltas, ``kind`` being
    ``reasoning_content`` or ``content``; :meth:`take_calls` gives the tool-call deltas made
    since its last call (OpenAI's streamed ``tool_calls`` items), :attr:`tool_calls` the calls
    so far, assembled."""

    reasoning: bool
    tools: bool
    _state: str = "start"  # start → reasoning → content → calls
    _pending: str = ""
    _skip_newlines: bool = False
    _calls: str = ""  # every character since the first <tool_call>
    _pos: int = 0  # in _calls: where the next call is looked for
    _open: int = -1  # in _calls: the open call's start (-1: none open)
    _args_at: int = -1  # in _calls: the open call's arguments sent up to here (-1: head unseen)
    _sent: int = 0  # characters of the open call's arguments sent (as generated)
    _in_string: bool = False  # where the arguments sent so far end: inside a JSON string,
    _escaped: bool = False  # right after a backslash there
    _deltas: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self._pending += piece
        out: list[tuple[str, str]] = []
        while self._pending:
            if self._state == "start":
                if not self.reasoning:
                    self._state = "content"
                elif self._pending.startswith(THINK_OPEN):
                    self._pending = self._pending[len(THINK_OPEN):]
                    self._state, self._skip_newlines = "reasoning", True
                elif THINK_OPEN.startswith(self._pending):
                    break  # not enough text to tell yet
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                if not self._skip_leading_newlines():
                    break
                if not self._emit(out, "reasoning_content", THINK_CLOSE):
                    break
                self._state, self._skip_newlines = "content", True
            elif self._state == "content":
                if not self._skip_leading_newlines():
                    break
                if not self.tools:
                    out.append(("content", self._pending))
                    self._pending = ""
                elif self._emit(out, "content", CALL_OPEN, keep_marker=True):
                    self._state = "calls"
                else:
                    break
            else:
                self._calls += self._pending
                self._pending = ""
                out += self._stream_calls(final=False)
        return [(k, t) for k, t in out if t]

    def take_calls(self) -> list[dict]:
        """The tool-call deltas since the last call: ``{"index", "id", "type", "function":
        {"name", "arguments": ""}}`` when a call starts, ``{"index", "function": {"arguments":
        piece}}`` as its arguments come."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _stream_calls(self, final: bool) -> list[tuple[str, str]]:
        text = self._calls
        while True:
            if self._open < 0:
                at = text.find(CALL_OPEN, self._pos)
                if at < 0:
                    return []
                self._open, self._args_at = at, -1
            head = _HEAD.match(text, self._open) if self._args_at < 0 else None
            if head is not None and head.end() < len(text):  # (all the whitespace is in)
                name = json.loads(f'"{head.group(1)}"', strict=False)  # as a whole answer's
                call = {"id": _call_id(), "type": "function",
                        "function": {"name": name, "arguments": ""}}
                self.tool_calls.append(call)
                self._deltas.append({"index": len(self.tool_calls) - 1, **call,
                                     "function": dict(call["function"])})
                self._args_at, self._sent = head.end(), 0
                self._in_string = self._escaped = False
            close = text.find(CALL_CLOSE, self._open)
            if close < 0:
                if self._args_at >= 0:  # the arguments so far, but what could end the call
                    avail = text[self._args_at:]
                    body = avail[:len(avail) - _held(avail, (CALL_CLOSE,))]
                    safe = body if final else body.rstrip()
                    safe = safe[:-1] if safe.endswith("}") and not final else safe
                    self._send_arguments(safe)
                return []
            if self._args_at >= 0:  # its arguments end at the call's closing brace
                body = text[self._args_at:close].rstrip()
                self._send_arguments(body[:-1].rstrip() if body.endswith("}") else body)
            else:  # written in another order: the whole call, parsed, at once
                _, calls = parse_tool_calls(text[self._open:close + len(CALL_CLOSE)])
                if not calls:
                    if not self.tool_calls:  # as in the whole text: content after all
                        self._state, self.tools = "content", False
                        rest, self._calls = text, ""
                        return [("content", rest)]
                    return []  # malformed after good calls: dropped, as whole texts drop them
                call = calls[0]
                self.tool_calls.append(call)
                self._deltas.append({"index": len(self.tool_calls) - 1, **call})
            self._pos, self._open = close + len(CALL_CLOSE), -1

    def _send_arguments(self, upto: str) -> None:
        """Send what ``upto`` adds to the arguments sent so far. A control character inside a
        JSON string (the model may write one raw; parsing the whole call tolerates it) goes out
        escaped, so the joined pieces are strict JSON."""
        if len(upto) <= self._sent:
            return
        out = []
        for ch in upto[self._sent:]:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                elif ch < " ":
                    ch = f"\\u{ord(ch):04x}"
            elif ch == '"':
                self._in_string = True
            out.append(ch)
        self._sent = len(upto)
        piece = "".join(out)
        self.tool_calls[-1]["function"]["arguments"] += piece
        self._deltas.append({"index": len(self.tool_calls) - 1,
                             "function": {"arguments": piece}})

    def _skip_leading_newlines(self) -> bool:
        """After a marker, newlines are not text: False while nothing else has come yet."""
        if self._skip_newlines:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return False
            self._skip_newlines = False
        return True

    def _emit(self, out: list, kind: str, marker: str, keep_marker: bool = False) -> bool:
        """Send the text before ``marker`` (newlines right before it are not text); True once
        the marker was found (consumed, or left at the head of the pending text with
        ``keep_marker``). Held back: a tail that could begin the marker, trailing newlines."""
        at = self._pending.find(marker)
        if at >= 0:
            out.append((kind, self._pending[:at].rstrip("\n")))
            self._pending = self._pending[at if keep_marker else at + len(marker):]
            return True
        hold = _held(self._pending, (marker,))
        hold += len(self._pending[:len(self._pending) - hold]) - \
            len(self._pending[:len(self._pending) - hold].rstrip("\n"))
        out.append((kind, self._pending[:len(self._pending) - hold]))
        self._pending = self._pending[len(self._pending) - hold:]
        return False

    def finish(self) -> list[tuple[str, str]]:
        """The end: held-back text goes out; an open call's arguments go out as they are (cut
        off by max_tokens); a call that never showed its head goes out as content."""
        out = []
        if self._state == "calls":
            out += self._stream_calls(final=True)
            if self._state == "calls" and self._open >= 0 and self._args_at < 0:
                if not self.tool_calls:
                    out.append(("content", self._calls))
        elif self._pending:
            kind = "reasoning_content" if self._state == "reasoning" else "content"
            out.append((kind, self._pending))
        self._pending = self._calls = ""
        return [(k, t) for k, t in out if t]


def tool_grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """EBNF (xgrammar's) for an output of tool calls only: of the function ``name``, or of any
    offered; one call, or (``parallel``) one or more separated by a newline."""
    import xgrammar as xgr

    offered = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    one_of = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in offered]
    schema = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
    try:
        arguments = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except RuntimeError as exc:  # a function's parameters are not a usable JSON schema
        raise BadRequest(f"tools: {xgrammar_message(exc)}") from None
    opening, closing = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    call = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {opening}"), arguments,
                              xgr.Grammar.from_ebnf(f"root ::= {closing}"))
    rules = str(call).replace("root ::=", "baton_call ::=", 1)
    more = ' ("\\n" baton_call)*' if parallel else ""
    return f"root ::= baton_call{more}\n{rules}"
