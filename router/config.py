"""The ingress's settings (``router:`` in a serving config), validated where the app is built and
where the ingress starts. Below ``deploy/`` so that the ingress imports no deploy code."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from router.ingress.door import DEFAULT_MAX_REQUEST_BYTES


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.25, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)  # client connections one ingress replica serves
    # Serve's direct ingress counts every request of a burst as queued until its handler runs,
    # even with free slots: a bound below the largest burst one ingress replica takes refuses
    # part of it (measured: 64 refused ~30 of 512 streams sent at once to 4 replicas).
    max_queued_requests: int = Field(1024, ge=-1)
    model_name: str | None = None  # the name served in /v1/models (default: the model spec)
    request_timeout_s: float = Field(300.0, gt=0)
    # A request with no first token this long after it arrived (every decode replica busy with
    # earlier work) is aborted and answered 429 with Retry-After, rather than left in a queue.
    # None: no bound but request_timeout_s.
    first_token_timeout_s: float | None = Field(60.0, gt=0)
    # A request no decode replica has taken this long after it was submitted (each holds its
    # max_ongoing_requests) is answered 429 with Retry-After at once, rather than left in
    # Serve's queue, where neither priority nor the engine's bounded wait reaches it (with no
    # decode replica alive, a disaggregated app sends it to the prefill replicas instead).
    # None: it waits there (up to first_token_timeout_s).
    queue_timeout_s: float | None = Field(None, gt=0)
    # The Retry-After of those refusals: the app builder sets it to admission.retry_after_s.
    retry_after_s: float = Field(1.0, gt=0)
    # What one decode replica holds (its max_ongoing_requests), set by the app builder: a queued
    # request is refused only while every live decode replica holds this many (a replica that
    # is starting has room: the request waits for it).
    decode_max_ongoing: int | None = Field(None, ge=1)
    # And what its Serve queue holds (max_queued_requests), set by the app builder too.
    decode_max_queued: int | None = Field(None, ge=-1)
    # Refuse a generation request at the door (429 with Retry-After, before its body is parsed
    # or its prompt tokenized) while this ingress replica has its share of what the decode pool
    # holds open: live decode replicas x (max_ongoing_requests + max_queued_requests) over the
    # ingress replicas. Beyond that Serve would refuse it anyway, after the ingress had worked
    # through every request ahead of it. HTTP only (gRPC calls reach Serve's bound). On a local
    # cluster HAProxy refuses beyond the whole bound itself, before the ingress
    # (router/ingress/haproxy.py); false turns both off.
    early_refusal: bool = True
    # Just before its Serve call, send each request over the token channel to the decode replica
    # the call then goes to, so its engine starts while the call travels; the call claims the
    # running request (router/replica_choice.py, docs/serving.md). Only to a replica with few
    # requests in flight. Colocated on H200s the app's share of a zero-load first token fell by
    # about 1 ms (5.7 to 4.7 ms). In a disaggregated app a decode replica sends each hand-over
    # to its prefill replica the same way, over its own token sink. false: requests and
    # hand-overs start when their calls arrive.
    early_start: bool = True
    # POST /v1/completions and /v1/chat/completions whose JSON body parses and validates go
    # from the door straight to the handler, past FastAPI's per-request routing and dependency
    # solving (router/ingress/http.py GenerationFastPath); every other request, refusals of
    # bad bodies included, is FastAPI's as before. false: all through FastAPI.
    http_fast_path: bool = True
    # Sequences one request may run (prompts of a batch × n or best_of): more is a 400 at once,
    # not a request that holds every slot (or could never be admitted).
    max_sequences_per_request: int = Field(256, ge=1)
    max_tokens_default: int = Field(16, ge=1)
    # Clients must send `Authorization: Bearer <key>` (gRPC: the same metadata) on every path but
    # /health and /metrics when a key is set. Prefer the BATON_API_KEY environment variable of
    # the ingress replicas (for example the app's runtime_env) to a key in the config file.
    api_key: str | None = Field(None, min_length=1)
    # A request body larger than this is refused with a 413 before it is parsed (gRPC messages
    # are bounded by gRPC itself: 4 MiB). A text prompt that cannot fit the context is refused
    # with a 400 after at most a context's worth of tokenizing (router/ingress/prompts.py).
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1024)
    # Chat answers: a leading <think>...</think> becomes `reasoning_content` (vLLM's qwen3
    # reasoning parser); "none" leaves it in `content`. Tool calls are parsed whenever a
    # request offers tools (Qwen3's <tool_call> form, vLLM's hermes parser).
    reasoning_parser: Literal["qwen3", "none"] = "qwen3"
