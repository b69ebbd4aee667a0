"""Text prompts to token ids, without blocking the ingress and without unbounded work.

Tokenizing is CPU work on the ingress's only event loop: a 2 MB prompt takes ~2 s, during which
every other request, ``/health`` and ``/metrics`` would wait. So:

- a short text (``INLINE_CHARS``) is tokenized on the loop (cheaper than a thread hop);
- a longer one goes to a small thread pool (the tokenizer releases the GIL while it works);
- a text that cannot fit the context is refused without tokenizing it when its length alone
  proves it (a token stands for at most ``max_token_bytes`` bytes, so a text of more than
  ``max_model_len * max_token_bytes`` characters has more than ``max_model_len`` tokens), and
  otherwise is tokenized in slices, cut before a space that starts a word (where the
  tokenizer's own pre-tokenizer cuts too), counting, and refused as soon as the count passes the
  context: the work for any text is bounded by the context, not by the text's size.

Chat messages are rendered with the chat template (to text, on the same path) and then
tokenized: the ids equal ``apply_chat_template(..., tokenize=True)``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
from concurrent.futures import ThreadPoolExecutor

from engine.errors import BadRequest

INLINE_CHARS = 4096
SLICE_CHARS = 32768
SLACK_PER_CUT = 8  # tokens a forced cut (no word boundary near) may add to the count
_WORD_START = re.compile(r"(?<=\S) (?=\w)")


def valid_text(text: str, field: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON allows ``"\\ud800"``) is a 400,
    not a tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{field}: not valid Unicode text (a lone surrogate at character "
                         f"{exc.start})") from None
    return text


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int, workers: int = 2):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_bytes = max((len(t.encode()) for t in tokenizer.get_vocab()), default=1)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        # What a request's chat_template_kwargs may not name: apply_chat_template's own
        # parameters (a template of the client's own, `chat_template`, would run unbounded work
        # on the loop; `tokenize`, `tools`, ... collide with the server's), as vLLM refuses them,
        # and the variables the renderer sets itself (the messages, the special tokens)
        params = inspect.signature(tokenizer.apply_chat_template).parameters.items()
        self.reserved = frozenset(
            name for name, p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) | {
            "chat_template", "self", "messages",
            *(getattr(tokenizer, "special_tokens_map", None) or {})}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self._encode(valid_text(text, "prompt"))
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.bounded, text)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the messages through the chat template (``tools`` and
        ``template_kwargs``, the request's ``chat_template_kwargs``, e.g. ``enable_thinking``,
        go to the template as its variables)."""
        for i, m in enumerate(messages):
            valid_text(str(m.get("content") or ""), f"messages.{i}.content")
        for key in template_kwargs or ():
            if key in self.reserved:
                raise BadRequest(f"chat_template_kwargs: {key!r} is not a template variable "
                                 "(the server's chat template renders the messages as it is)")
        size = sum(len(str(m.get("content") or "")) for m in messages) + \
            len(str(tools or "")) + len(str(template_kwargs or ""))
        render = functools.partial(self._render, messages, add_generation_prompt, tools,
                                   template_kwargs)
        if size <= INLINE_CHARS:
            return self._encode(render())
        loop = asyncio.get_running_loop()
        self.refuse_by_length(size)
        text = await loop.run_in_executor(self.pool, render)
        return await loop.run_in_executor(self.pool, self.bounded, text)

    def _render(self, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt,
                tokenize=False, **(template_kwargs or {}))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # jinja's own errors too
            raise BadRequest(f"messages: the chat template cannot render them: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - jinja2 TemplateError and the like
            if type(exc).__module__.startswith("jinja2"):
                raise BadRequest(f"messages: the chat template cannot render them: {exc}") \
                    from None
            raise

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def refuse_by_length(self, chars: int) -> None:
        if chars > self.max_model_len * self.max_token_bytes:
            raise BadRequest(
                f"prompt: {chars} characters are more than the model's context of "
                f"{self.max_model_len} tokens can hold (a token covers at most "
                f"{self.max_token_bytes} bytes)")

    def bounded(self, text: str) -> list[int]:
        """``encode``, but a text whose first slices already pass the context is refused."""
        self.refuse_by_length(len(text))
        valid_text(text, "prompt")
        if len(text) > SLICE_CHARS:
            counted, cuts, start = 0, 0, 0
            while start < len(text):
                end = self._cut(text, start)
                forced = end < len(text) and text[end] != " "
                counted += len(self._encode(text[start:end]))
                cuts += forced
                if counted > self.max_model_len + SLACK_PER_CUT * cuts:
                    raise BadRequest(
                        f"prompt: longer than the model's context of {self.max_model_len} "
                        f"tokens ({counted} tokens in its first {end} of {len(text)} "
                        "characters)")
                start = end
        return self._encode(text)

    @staticmethod
    def _cut(text: str, start: int) -> int:
        """The end of the slice from ``start``: before the last word-starting space in the
        window, or at the window's end when there is none."""
        end = start + SLICE_CHARS
        if end >= len(text):
            return len(text)
        last = None
        for last in _WORD_START.finditer(text, start + SLICE_CHARS // 2, end):
            pass
        return last.start() if last is not None else end
