from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "request_id", "model", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "top_logprobs", "json_schema", "json_object", "regex", "choice", "grammar", "disable_any_whitespace", "n", "priority", "prompt_logprobs", "include_timing")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TIMING_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    request_id: str
    model: str
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    disable_any_whitespace: bool
    n: int
    priority: int
    prompt_logprobs: int
    include_timing: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., n: _Optional[int] = ..., priority: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., include_timing: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "logprobs", "usage", "ttft_s", "produced_at", "top_logprobs", "index", "choices", "prompt_logprobs", "prompt_top_logprobs", "timing_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_AT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMING_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    usage: Usage
    ttft_s: float
    produced_at: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    index: int
    choices: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    timing_json: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., ttft_s: _Optional[float] = ..., produced_at: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., timing_json: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "model")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    status: str
    model: str
    def __init__(self, status: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...
