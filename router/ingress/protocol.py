"""OpenAI-compatible request bodies, validated with pydantic; unknown or unsupported fields are
refused with a message that names them."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.errors import BadRequest
from engine.generation_config import resolve
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.structured import StructuredOutput

log = logging.getLogger("ray.serve.baton.protocol")


MAX_PROMPTS_PER_REQUEST = 128  # a batch in /v1/completions: one decode request per prompt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # A last chunk with usage and no choices, only when asked (OpenAI's and vLLM's behaviour:
    # clients read ``chunk.choices[0]`` of every chunk).
    include_usage: bool = False
    # Baton extension: each chunk carries ``produced_at`` (when the engine produced its oldest
    # token, Unix seconds) and the usage chunk a ``timing`` of the request's milestones.
    include_timing: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON of a schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise BadRequest("response_format: type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (EBNF); ``disable_any_whitespace``: JSON output (from here or from
    ``response_format``) without whitespace between tokens."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


def structure(kind: str, value) -> StructuredOutput | None:
    """The structured output of vLLM's ``guided_<kind>`` (also gRPC's fields): ``json`` (a
    schema, as a dict or JSON text), ``regex``, ``choice``, ``grammar``; None for no value."""
    if value is None:
        return None
    if kind == "json":
        return StructuredOutput.schema(value)
    if kind == "choice":
        return StructuredOutput.choice(value)
    return StructuredOutput(kind=kind, spec=value)


def _one_structure(named: dict) -> StructuredOutput | None:
    """The one structured output a request names (a 400 naming them when it names several)."""
    named = {k: v for k, v in named.items() if v is not None}
    if len(named) > 1:
        raise BadRequest(f"{' and '.join(sorted(named))}: give one structured output, not "
                         f"{len(named)}")
    return next(iter(named.values()), None)


class _Common(BaseModel):
    # Unknown top-level fields are accepted and ignored, with a warning in the log (vLLM's
    # behaviour: clients add fields of other servers); wrong types and values of known fields,
    # unknown fields inside known objects, NaN and infinities are refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _ignore_unknown_fields(self):
        if self.model_extra:
            log.warning("request fields ignored (not supported): %s", sorted(self.model_extra))
            self.model_extra.clear()
        return self

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # what current OpenAI clients send; wins
    # Unset (None): the model's generation config (engine.generation_config), else the
    # engine's defaults (temperature 1, no top-k, top-p or min-p, no repetition penalty).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Baton extension: a whole (not streamed) answer's usage carries the request's timeline
    # (streamed: stream_options.include_timing).
    include_timing: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extensions, as vLLM names them.
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    priority: int = 0  # vLLM's: lower is scheduled first; equal ones in arrival order
    # vLLM's: each prompt token's logprob and the k most likely there, in the choice's
    # ``prompt_logprobs`` (None first: the first token has no context)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Sent by OpenAI clients and frameworks, with no effect on the output here: accepted, ignored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def sampling_params(self, default_max_tokens: int, logprobs: int | None,
                        best_of: int | None = None,
                        defaults: Mapping = MappingProxyType({})) -> SamplingParams:
        """The request's sampling parameters (``BadRequest`` naming a bad field); ``defaults``:
        the model's generation config for the fields left unset
        (:func:`engine.generation_config.sampling_defaults`)."""
        limit = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None),
                     None)
        return SamplingParams(
            **resolve({"max_tokens": limit, "temperature": self.temperature, "top_p": self.top_p,
                       "top_k": self.top_k, "min_p": self.min_p,
                       "repetition_penalty": self.repetition_penalty}, defaults,
                      default_max_tokens),
            seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, n=self.n, best_of=best_of,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens, logit_bias=self.logit_bias, priority=self.priority,
            prompt_logprobs=self.prompt_k(logprobs),
            structured_output=self.structured_output())

    def prompt_k(self, logprobs: int | None) -> int | None:
        """The prompt logprobs the answer needs (the top k of each position), or None."""
        return self.prompt_logprobs

    def structured_output(self) -> StructuredOutput | None:
        rf, so = self.response_format, self.structured_outputs or StructuredOutputs()
        named = {"response_format": None if rf is None or rf.type == "text" else
                 StructuredOutput(kind="json_object") if rf.type == "json_object" else
                 StructuredOutput.schema(rf.json_schema.schema_)}
        for kind in ("json", "regex", "choice", "grammar"):
            named[f"guided_{kind}"] = structure(kind, getattr(self, f"guided_{kind}"))
            named[f"structured_outputs.{kind}"] = structure(
                kind, getattr(so, "json_" if kind == "json" else kind))
        chosen = _one_structure(named)
        if chosen is not None and so.disable_any_whitespace \
                and chosen.kind in ("json_schema", "json_object"):
            return chosen.model_copy(update={"compact": True})
        return chosen


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _batch_size(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)) \
                and len(v) > MAX_PROMPTS_PER_REQUEST:
            raise BadRequest(f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, "
                             f"got {len(v)}")
        return v

    def prompt_k(self, logprobs: int | None) -> int | None:
        """``echo`` with ``logprobs``: the echoed prompt's tokens get theirs too (OpenAI's
        legacy completions), with the same top k."""
        if self.echo and logprobs is not None:
            return max(logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (one choice each, in order)."""
        v = self.prompt
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            return list(v)
        return [v]

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.suffix:
            raise BadRequest("suffix: not supported")
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of: not supported when streaming (the best are known only "
                             "at the end)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of parts as current clients send (text parts only here); an
    # assistant turn that only calls tools may have none.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant; dropped from the prompt by the template

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if v is None or isinstance(v, str):
            return v
        other = sorted({p.type for p in v if p.type != "text"})
        if other:
            raise BadRequest(f"content: parts of type {', '.join(other)} are not supported "
                             "(text only)")
        return "".join(p.text or "" for p in v)

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, v):
        return "system" if v == "developer" else v  # OpenAI's newer name for the system role

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise BadRequest(f"content: a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise BadRequest("tool_calls: only an assistant message has them")
        return self

    def for_template(self) -> dict:
        """The message as a chat template reads it (arguments parsed, as Qwen3's renders)."""
        m = self.model_dump(exclude_none=True)
        for call in m.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except (ValueError, RecursionError):
                pass  # not JSON (or nested past the parser's depth): rendered as sent
        return m


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # Default: "auto" with tools, "none" without (as OpenAI).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Passed to the chat template, e.g. {"enable_thinking": false} for Qwen3 (as vLLM does).
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _unsupported_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs: needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise BadRequest("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in \
                {t.function.name for t in self.tools}:
            raise BadRequest(f"tool_choice: no tool named {choice.function.name!r} in tools")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise BadRequest("tools: two functions have one name")
        return self

    @property
    def logprobs_asked(self) -> int | None:
        """The engine's ``logprobs``: None, or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> str:
        """``none`` (no tools in the prompt, nothing parsed), ``auto`` (offered, parsed) or
        ``forced`` (``required`` or a named function: the output is calls, by grammar)."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if not self.tools or choice == "none":
            return "none"
        return "auto" if choice == "auto" else "forced"

    def tool_grammar(self) -> StructuredOutput | None:
        if self.tool_mode != "forced":
            return None
        if self.structured_output() is not None:
            raise BadRequest("tool_choice: a required or named tool call cannot be combined "
                             "with a structured output")
        from router.ingress.chat import tool_grammar

        name = self.tool_choice.function.name \
            if isinstance(self.tool_choice, NamedToolChoice) else None
        spec = tool_grammar([t.model_dump(exclude_none=True) for t in self.tools], name,
                            self.parallel_tool_calls and name is None)
        return StructuredOutput(kind="grammar", spec=spec)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text, or chat messages through the chat template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
