"""The ingress: OpenAI-compatible HTTP (FastAPI through Serve) and gRPC, in one deployment.

Per request: validate → apply the chat template → tokenize → start it on a decode replica
(:class:`~router.ingress.streams.DecodeClient`; its tokens come back over the token channel, not
as Serve items) → detokenize and check stop strings as they arrive → SSE chunks, a JSON body, or
gRPC messages, each carrying every token that arrived since the previous one. Bad input is a 400
in OpenAI's error format (gRPC: INVALID_ARGUMENT); a request that cannot be served in time ends
with an error, never a silent hang.
"""

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext

from contracts.messages import TIMELINE, GenerateResult, timeline
from engine import SamplingParams
from engine.sampling_params import best_indices, fan_out
from engine.structured import Grammars, StructuredOutput
from engine.loader import load_tokenizer, resolve_model
from engine.quantization import resolve_scheme
from proto import baton_pb2
from router.ingress.door import (APIKeyMiddleware, BodyLimitMiddleware,
                                 StatusCountMiddleware, authorized)
from contracts.metrics import replica_id
from router.config import RouterConfig
from router.ingress.errors import RequestTimeout, UnknownModel, describe, log_failure
from router.ingress.chat import StreamSplitter, split_message
from router.ingress.logprobs import TokenTexts
from router.ingress.metrics import RouterMetrics
from router.ingress.prompts import PromptEncoder
from router.ingress.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, TokenizeRequest, structure)
from router.ingress.streams import Chunk, DecodeClient, RequestStream

app = FastAPI(title="Baton")
TEXT, CHAT = "text_completion", "chat.completion"  # the two endpoints' answer objects
API_KEY_ENV = "BATON_API_KEY"
# The last added runs first: the key is checked before any of the body is read.
app.add_middleware(BodyLimitMiddleware)
app.add_middleware(APIKeyMiddleware)
app.add_middleware(StatusCountMiddleware)


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "code": status}})


@app.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, exc: StarletteHTTPException):
    """FastAPI's own refusals (a body that is not JSON or not UTF-8, an unknown path) in
    OpenAI's error format instead of ``{"detail": ...}``."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), kind)


@app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError):
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc and loc not in msg else msg)
    return error_response(400, "; ".join(parts))


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Refused(Exception):
    """Raised by a streaming body before its first chunk: answer with this status instead."""

    def __init__(self, response: JSONResponse):
        super().__init__(response.status_code)
        self.response = response


def error_for(exc: BaseException, request_id: str) -> JSONResponse:
    """The OpenAI-style error answer to a request that failed before its first token (logged:
    one line for a client's error, the traceback for a server fault)."""
    failure = describe(exc, request_id)
    log_failure(failure, exc, request_id)
    resp = JSONResponse(status_code=failure.status, content=failure.body())
    if failure.retry_after is not None:
        resp.headers["Retry-After"] = str(failure.retry_after)
    return resp


class DeferredStreamingResponse(StreamingResponse):
    """A stream whose status is decided with its first chunk: a body that raises
    :class:`Refused` before yielding anything is answered with that response instead (a 429 or
    400 with its headers), not with a 200 and an in-band error."""

    async def stream_response(self, send) -> None:
        try:
            first = await self.body_iterator.__anext__()
        except Refused as refused:
            await _send_whole(refused.response, send)
            return
        except StopAsyncIteration:
            first = None
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for chunk in ([first] if first is not None else []):
            await send({"type": "http.response.body", "body": chunk.encode(),
                        "more_body": True})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(response: Response, send) -> None:
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


def _transfer(result: GenerateResult | None) -> dict | None:
    if result is None or result.transfer is None:
        return None
    t = result.transfer
    return {"bytes": t.bytes, "blocks_sent": t.blocks_sent, "blocks_skipped": t.blocks_skipped,
            "seconds": t.seconds, "backend": t.backend, "src_node": t.src_node,
            "dst_node": t.dst_node, "prefill_seconds": result.prefill_seconds}


def _usage(streams: list[RequestStream], results: list[GenerateResult | None],
           per_prompt: int = 1) -> dict:
    """Usage of one request, summed over its sequences (``per_prompt`` of each prompt: its
    prompt counts once, as OpenAI counts it); ``kv_transfer`` one per sequence when several."""
    firsts = streams[::per_prompt]
    n_in = sum(s.num_prompt_tokens for s in firsts)
    n_out = sum(len(s.token_ids) for s in streams)
    transfers = [_transfer(r) for r in results]
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens
                                                           for s in firsts)},
            "kv_transfer": transfers[0] if len(transfers) == 1 else transfers}


def _message(text: str, parsing: tuple[bool, bool]) -> dict:
    """A chat choice's ``message``: the reasoning apart, tool calls parsed (content then None
    when there is none besides them)."""
    reasoning, content, calls = split_message(text, *parsing)
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
        message["content"] = content or None
    return message


def _log_timeline(stream: RequestStream, outcome: str, ingress: str) -> None:
    """One line per request at the ingress; the decode replica logs its own under the same id
    (``<id>~<n>`` after the n-th migration)."""
    names = _replicas(stream.result, ingress)
    TIMELINE.info("request %s ingress: %s, %d prompt + %d output tokens, %d migrations; "
                  "decode %s, prefill %s; %s", stream.request_id, outcome,
                  stream.num_prompt_tokens, len(stream.token_ids), stream.migrations,
                  names["decode"] or "-", names["prefill"] or "-",
                  timeline(**dict(phases(stream, stream.result))))


def phases(stream: RequestStream, result: GenerateResult | None) -> list[tuple[str, float]]:
    """The request's milestones across the roles, in causal order (``time.time()`` of each
    replica's host: on several nodes, as far apart as their clocks)."""
    t, d = stream.timing, result.timing if result is not None else None
    p = d.prefill if d is not None else None
    marks = [("received", t.received), ("submitted", t.submitted)]
    if d is not None:
        marks += [("decode_received", d.received), ("prefill_called", d.prefill_called)]
    if p is not None:
        marks += [("prefill_received", p.received), ("prefilled", p.prefilled),
                  ("pushed", p.pushed)]
    if d is not None:
        marks += [("prefill_returned", d.prefill_returned),
                  ("admitted" if p is not None else "queued", d.queued),
                  ("decode_first_token", d.first_token)]
    marks += [("first_token", t.first_token)]
    marks += [(f"moved{i + 1}", at) for i, at in enumerate(stream.moved_at)]
    marks += [("finished", t.finished or time.time())]
    return [(name, at) for name, at in marks if at]


def _replicas(result: GenerateResult | None, ingress: str) -> dict:
    d = result.timing if result is not None else None
    return {"ingress": ingress, "decode": d.replica if d is not None else None,
            "prefill": d.prefill.replica if d is not None and d.prefill is not None else None}


def _timing(stream: RequestStream, result: GenerateResult | None, ingress: str) -> dict:
    return {"phases": [[name, at] for name, at in phases(stream, result)],
            "replicas": _replicas(result, ingress), "router": asdict(stream.timing),
            "decode": asdict(result.timing) if result is not None else None}


def _grpc_status(grpc_context, code, message: str) -> None:
    """The status the client sees. The handler then returns normally (Serve sends a status set on
    the context; a raised exception would also be logged with its traceback)."""
    grpc_context.set_code(code)
    grpc_context.set_details(message)


# GenerateRequest's optional sampling fields, passed on when set (the engine's defaults if not).
_GRPC_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")


def _grpc_structure(req) -> StructuredOutput | None:
    which = req.WhichOneof("structured_output")
    if which == "json_object":
        so = StructuredOutput(kind="json_object") if req.json_object else None
    elif which == "choice":
        so = structure("choice", req.choice.options)
    else:
        so = structure("json" if which == "json_schema" else which,
                       getattr(req, which) if which else None)
    if so is not None and req.disable_any_whitespace and so.kind in ("json_schema",
                                                                      "json_object"):
        return so.model_copy(update={"compact": True})
    return so


def _grpc_top(chunk: Chunk) -> list:
    return [baton_pb2.TopLogprobs(token_ids=[t for t, _ in alts], logprobs=[lp for _, lp in alts])
            for alts in chunk.top_logprobs or ()]


class _Merged:
    """The chunks of one sequence, or of several as they come: ``(index, chunk)``; ``items``
    are ``(prompt ids, one-sequence params)``, a batch's prompts each fanned out into its ``n``
    (or ``best_of``) sequences. One sequence is followed directly (the hot path); several are
    all started here and each is read by a task of its own, the chunks meeting in a queue.
    ``streams`` and ``results`` are filled once all have ended; ``aclose`` stops what still
    runs (a client that left, a failed batch)."""

    def __init__(self, router: "Router", items: list[tuple[list[int], SamplingParams]],
                 rids: list[str]):
        self.router, self.items, self.rids = router, items, rids
        self.streams: list[RequestStream] = []
        self.results: list[GenerateResult | None] = []
        self._tasks: list[asyncio.Future] = []
        self._chunks = self._follow()

    def __aiter__(self):
        return self._chunks

    async def _follow(self):
        if len(self.items) == 1:
            (ids, params), = self.items
            async with self.router.request(ids, params, self.rids[0]) as stream:
                async for chunk in stream.chunks(stream.deadline):
                    yield 0, chunk
                self.streams, self.results = [stream], [await self.router.finish(stream)]
            return
        async with AsyncExitStack() as stack:
            # Each under a Serve request id of its own (``in_batch``; see DecodeClient._submit).
            streams = [await stack.enter_async_context(
                self.router.request(ids, params, rid, in_batch=True))
                for (ids, params), rid in zip(self.items, self.rids)]
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: RequestStream) -> None:
                try:
                    async for chunk in stream.chunks(stream.deadline):
                        queue.put_nowait((i, chunk, None))
                    queue.put_nowait((i, None, None))
                except Exception as exc:  # noqa: BLE001 - the reader raises it
                    queue.put_nowait((i, None, exc))

            self._tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
            live = len(streams)
            while live:
                i, chunk, exc = await queue.get()
                if exc is not None:
                    raise exc
                if chunk is None:
                    live -= 1
                    continue
                yield i, chunk
            self.streams = streams
            self.results = [await self.router.finish(st) for st in streams]

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self._chunks.aclose()  # leaves the ``request`` contexts now, not at collection


def warn_if_open_without_key(api_key: str | None) -> None:
    """Say so loudly, at start, when the app listens beyond this machine with no API key."""
    if api_key:
        return
    try:
        from ray.serve.context import _get_global_client
        host = _get_global_client().http_config.host
    except Exception:  # noqa: BLE001 - not under a Serve controller (tests driving the class)
        return
    if host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("ray.serve").warning(
            "WARNING: the HTTP port listens on %s (beyond this machine) with no API key: anyone "
            "who reaches it can use the model. Set BATON_API_KEY or router.api_key.", host)


@serve.deployment(name="Router", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
@serve.ingress(app)
class Router:
    def __init__(self, decode, model: str, served_name: str, max_model_len: int | None,
                 config: dict | None = None, engine: dict | None = None):
        import ray

        cfg = RouterConfig(**(config or {}))
        self.api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
        APIKeyMiddleware.key = self.api_key
        BodyLimitMiddleware.max_bytes = cfg.max_request_bytes

        source = resolve_model(model)
        self.tokenizer = load_tokenizer(source)
        self.texts = TokenTexts(self.tokenizer)
        self.grammars: Grammars | None = None  # structured outputs, checked at the door
        self.client = DecodeClient(decode, self.tokenizer, ray.util.get_node_ip_address())
        self.vocab_size = source.config.vocab_size
        self.max_model_len = min(max_model_len or source.config.max_position_embeddings,
                                 source.config.max_position_embeddings)
        self.prompts = (PromptEncoder(self.tokenizer, self.max_model_len)
                        if self.tokenizer is not None else None)
        self.served_name = served_name
        engine = engine or {}  # what the replicas run, said in /v1/models
        scheme = resolve_scheme(source.config.quantization, engine.get("quantization"), model)
        self.card_extras = {"quantization": scheme.name if scheme else None,
                            "kv_cache_dtype": engine.get("kv_cache_dtype", "auto")}
        self.timeout_s = cfg.request_timeout_s
        self.default_max_tokens = cfg.max_tokens_default
        self.reasoning_parser = cfg.reasoning_parser
        self.replica = replica_id()
        self.metrics = RouterMetrics()
        StatusCountMiddleware.count = self.metrics.count_http
        self.decode = decode
        warn_if_open_without_key(self.api_key)

    # -- shared path ------------------------------------------------------------------------
    async def prompt_ids(self, prompt) -> list[int]:
        """Token ids of a text (tokenized off the event loop when long) or of an id list."""
        if isinstance(prompt, str):
            if self.prompts is None:
                raise ValueError(f"prompt: model {self.served_name!r} has no tokenizer; send "
                                 "token ids")
            return self.checked(await self.prompts.encode(prompt))
        return self.checked(list(prompt))

    def checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("prompt: must not be empty")
        self.in_vocabulary(ids, "prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within the "
                             f"model's context of {self.max_model_len} tokens")
        return ids

    def in_vocabulary(self, ids: list[int], field: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{field}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return ids

    async def check_structure(self, params: SamplingParams) -> None:
        """A structured output that does not compile is the client's error: refused here, off
        the event loop (a big schema takes a while), before any replica sees it."""
        so = params.structured_output
        if so is None:
            return
        if self.tokenizer is None:
            raise ValueError(f"structured output: model {self.served_name!r} has no tokenizer")
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size,
                                     [self.tokenizer.eos_token_id or 0])
        await asyncio.to_thread(self.grammars.compile, so)

    async def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.prompts is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: model {self.served_name!r} has no chat template")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] \
            if body.tool_mode != "none" else None
        return self.checked(await self.prompts.render_chat(
            [m.for_template() for m in body.messages], tools=tools,
            **(body.chat_template_kwargs or {})))

    def check_params(self, ids: list[int], params: SamplingParams) -> None:
        """What the engine cannot check: stop strings need text; the whole request must fit
        the context (so a huge ``max_tokens`` is refused, not run for minutes)."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        self.in_vocabulary(params.token_ids_used(), "logit_bias/stop_token_ids")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: {params.max_tokens} new tokens after a {len(ids)}-token "
                             f"prompt exceed the model's context of {self.max_model_len} tokens")

    @asynccontextmanager
    async def request(self, ids: list[int], params: SamplingParams, request_id: str,
                      in_batch: bool = False):
        """A started request, with its metrics; a writer that leaves cancels it."""
        received, start = time.time(), time.monotonic()
        metrics = self.metrics

        def on_token(gap: float | None, _produced_at: float) -> None:
            if gap is None:
                metrics.ttft.observe(time.monotonic() - start)
            else:
                metrics.itl.observe(gap)

        stream = await self.client.start(ids, params, request_id, on_token, received,
                                         own_serve_id=in_batch)
        stream.deadline = start + self.timeout_s
        metrics.in_flight.inc()
        outcome = "error"
        try:
            yield stream
            outcome = stream.finish_reason or "error"
        except RequestTimeout:
            outcome = "timeout"
            raise
        except BackPressureError:
            outcome = "refused"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"  # the client went away
            raise
        finally:
            self.client.close(stream)
            metrics.in_flight.dec()
            metrics.requests.labels(outcome).inc()
            metrics.tokens.inc(len(stream.token_ids))
            metrics.migrations.inc(stream.migrations)
            metrics.e2e.observe(time.monotonic() - start)
            _log_timeline(stream, outcome, self.replica)

    async def finish(self, stream: RequestStream) -> GenerateResult | None:
        """The decode replica's result (usage, transfer stats for the answer's usage)."""
        return await self.client.result(stream)

    # -- HTTP -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        """Ready: 200 once a decode replica answers (so the app can serve a request), else 503
        (Serve still starting or replacing them). ``/livez`` is this replica alone."""
        if await self.ready():
            return {"status": "ok"}
        return JSONResponse(status_code=503, content={"status": "unavailable", "message":
                            "no decode replica answers yet (starting, or being replaced)"})

    @app.get("/livez")
    async def livez(self):
        """Alive: this ingress replica answers, whatever the rest of the app does."""
        return {"status": "ok"}

    async def ready(self, timeout_s: float = 2.0) -> bool:
        """A decode replica answers a trivial call within ``timeout_s``."""
        try:
            await asyncio.wait_for(self.decode.kv_load.remote(), timeout_s)
        except Exception:  # noqa: BLE001 - none placed, none running, or one failing
            return False
        return True

    def _model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "owned_by": "baton", "created": 0,
                "max_model_len": self.max_model_len, **self.card_extras}

    def _unknown_model(self, name: str | None) -> JSONResponse | None:
        """A 404 for a model this app does not serve (as OpenAI and vLLM answer)."""
        if name is None or name == self.served_name:
            return None
        return JSONResponse(status_code=404, content={"error": {
            "message": f"model {name!r} does not exist; this server serves "
                       f"{self.served_name!r}",
            "type": "not_found_error", "param": "model", "code": "model_not_found"}})

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        return self._unknown_model(model_id) or self._model_card()

    @app.get("/metrics")
    async def metrics_endpoint(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        """Token ids of a text or of chat messages, as the completions would see them."""
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        if self.prompts is None:
            return error_response(400, f"model {self.served_name!r} has no tokenizer")
        try:
            if body.prompt is not None:
                ids = await self.prompts.encode(body.prompt)
            else:
                ids = await self.prompts.render_chat(
                    [m.for_template() for m in body.messages], body.add_generation_prompt)
        except ValueError as exc:
            return error_for(exc, "tokenize")
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        if self.tokenizer is None:
            return error_response(400, f"model {self.served_name!r} has no tokenizer")
        try:
            return {"prompt": self.tokenizer.decode(self.in_vocabulary(body.tokens, "tokens"))}
        except ValueError as exc:
            return error_for(exc, "detokenize")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._generate(body, TEXT, self._completion_inputs)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._generate(body, CHAT, self._chat_inputs)

    async def _completion_inputs(self, body: CompletionRequest):
        """One prompt or a batch (text or ids), ``best_of``; with ``echo``, each prompt's text."""
        prompts = body.prompts()
        batch = [await self.prompt_ids(p) for p in prompts]
        params = body.sampling_params(self.default_max_tokens, body.logprobs, body.best_of)
        echo = [p if isinstance(p, str) else self._text(ids)
                for p, ids in zip(prompts, batch)] if body.echo else None
        return batch, params, echo

    async def _chat_inputs(self, body: ChatCompletionRequest):
        """One prompt, the messages through the chat template; a forced tool call's grammar."""
        ids = await self.chat_ids(body)
        params = body.sampling_params(self.default_max_tokens, body.logprobs_asked)
        if (calls := body.tool_grammar()) is not None:  # required / a named function
            params = params.model_copy(update={"structured_output": calls})
        return [ids], params, None

    async def _generate(self, body, kind: str, inputs):
        """What both endpoints share. ``inputs(body)`` gives ``(batch, params, echo)``:
        ``batch`` the prompts' token ids, each prompt getting ``n`` choices (``index`` =
        prompt × n + choice) from ``n`` sequences, or the best ``n`` of ``best_of``; ``echo``
        each prompt's text, to put before its completions (or None). A bad request is a 400
        before any replica sees it; then an SSE stream or a whole answer."""
        rid = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        try:
            batch, params, echo = await inputs(body)
            for ids in batch:
                self.check_params(ids, params)
            await self.check_structure(params)
        except ValueError as exc:
            return error_for(exc, rid)
        if body.stream:
            return DeferredStreamingResponse(self._sse(batch, params, rid, kind, body, echo),
                                             media_type="text/event-stream")
        return await self._complete(batch, params, rid, kind, body, echo)

    def _parsing(self, body) -> tuple[bool, bool]:
        """(reasoning, tools): what a chat answer's text is split into."""
        return self.reasoning_parser == "qwen3", body.tool_mode != "none"

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _feed(self, batch, params: SamplingParams, rid: str) -> _Merged:
        """Every sequence of the request, prompt by prompt (``num_sequences`` each), merged;
        one sequence keeps the request's id, several get ``<id>-<i>``."""
        children = fan_out(params)
        items = [(ids, child) for ids in batch for child in children]
        n = len(items)
        return _Merged(self, items, [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)])

    def _logprobs(self, chat: bool, chunk_or_stream, offset: int = 0) -> tuple[dict, int]:
        c = chunk_or_stream
        if chat:
            return self.texts.chat(c.token_ids, c.logprobs, c.top_logprobs), offset
        return self.texts.completion(c.token_ids, c.logprobs, c.top_logprobs, offset)

    async def _complete(self, batch, params, rid, kind: str, body, echo=None):
        feed = self._feed(batch, params, rid)
        texts = [[] for _ in feed.items]
        try:
            async for index, chunk in feed:
                texts[index].append(chunk.text)
        except Exception as exc:  # noqa: BLE001 - a bad request, overload, a failed replica
            return error_for(exc, rid)
        finally:
            await feed.aclose()
        chat = kind == CHAT
        parsing = self._parsing(body) if chat else None
        k, shown = params.num_sequences, params.logprobs is not None
        choices = []
        for p in range(len(batch)):
            group = feed.streams[p * k:(p + 1) * k]
            picked = best_indices(params, [sum(s.logprobs or ()) for s in group])
            for j, g in enumerate(picked):
                stream, text = group[g], "".join(texts[p * k + g])
                choice = {"index": p * params.n + j, "finish_reason": stream.finish_reason,
                          "token_ids": stream.token_ids}
                head = echo[p] if echo else ""
                lp = self._logprobs(chat, stream, len(head))[0] if shown else None
                if chat:
                    choice["message"] = _message(text, parsing)
                    if choice["message"].get("tool_calls") and stream.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
                else:
                    choice["text"] = head + text
                choice["logprobs"] = lp
                choices.append(choice)
        usage = self._usage(feed, params, body.include_timing)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.served_name,
                "choices": choices, "usage": usage}

    def _usage(self, feed: _Merged, params: SamplingParams, timed: bool) -> dict:
        """The answer's usage, with the request's timeline when asked (one sequence only)."""
        usage = _usage(feed.streams, feed.results, params.num_sequences)
        if timed and len(feed.streams) == 1:
            usage["timing"] = _timing(feed.streams[0], feed.results[0], self.replica)
        return usage

    async def _sse(self, batch, params, rid, kind: str, body, echo=None) -> AsyncIterator[str]:
        created = int(time.time())
        chat = kind == CHAT
        options = body.stream_options
        timed = options is not None and options.include_timing
        head = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                "model": self.served_name}
        feed = self._feed(batch, params, rid)  # streaming: best_of is n, so sequence i is choice i
        shown, n = params.logprobs is not None, params.n
        started: set[int] = set()
        offsets = [len(echo[i // n]) if echo else 0 for i in range(len(feed.items))]
        splitters = [StreamSplitter(*self._parsing(body)) for _ in feed.items] if chat else []

        def event(index: int, chunk: Chunk) -> str:
            choice = {"index": index, "finish_reason": chunk.finish_reason,
                      "token_ids": chunk.token_ids}
            lp = None
            if shown and chunk.token_ids:
                lp, offsets[index] = self._logprobs(chat, chunk, offsets[index])
            if chat:
                splitter = splitters[index]
                parts = splitter.feed(chunk.text) + (splitter.finish() if chunk.finished else [])
                delta = {}
                for part, text in parts:
                    delta[part] = delta.get(part, "") + text
                if splitter.tool_calls and chunk.finished:
                    delta["tool_calls"] = [{"index": j, **call}
                                           for j, call in enumerate(splitter.tool_calls)]
                    if chunk.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
                choice["delta"] = delta or {"content": ""}
            else:
                text = chunk.text
                if echo and index not in started:
                    text = echo[index // n] + text
                choice["text"] = text
            choice["logprobs"] = lp
            started.add(index)
            obj = {**head, "choices": [choice]}
            if timed:
                obj["produced_at"] = chunk.produced_at
            return _event(obj)

        sent = False
        try:
            async for index, chunk in feed:
                if chat and index not in started:
                    yield _event({**head, "choices": [{
                        "index": index, "finish_reason": None, "token_ids": [],
                        "delta": {"role": "assistant", "content": ""}, "logprobs": None}]})
                sent = True
                yield event(index, chunk)
        except Exception as exc:  # noqa: BLE001 - before the first chunk: a real status code
            if not sent:
                raise Refused(error_for(exc, rid)) from exc
            failure = describe(exc, rid)  # after the 200: the error rides in the stream
            log_failure(failure, exc, rid)
            yield _event(failure.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await feed.aclose()
        if options is not None and (options.include_usage or options.include_timing):
            yield _event({**head, "choices": [], "usage": self._usage(feed, params, timed)})
        yield "data: [DONE]\n\n"

    # -- gRPC (Serve's gRPC proxy calls these by RPC name) ------------------------------------
    async def _grpc_inputs(self, req) -> tuple[list[int], SamplingParams]:
        if req.prompt and req.prompt_token_ids:
            raise ValueError("prompt: give either prompt or prompt_token_ids, not both")
        ids = await self.prompt_ids(req.prompt if req.prompt else list(req.prompt_token_ids))
        fields = {name: getattr(req, name) for name in _GRPC_OPTIONAL if req.HasField(name)}
        fields.setdefault("max_tokens", self.default_max_tokens)
        if req.HasField("top_logprobs") and not req.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        logprobs = (req.top_logprobs if req.HasField("top_logprobs") else 0) \
            if req.logprobs else None
        params = SamplingParams(stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
                                ignore_eos=req.ignore_eos, logprobs=logprobs,
                                logit_bias=dict(req.logit_bias),
                                structured_output=_grpc_structure(req), **fields)
        self.check_params(ids, params)
        await self.check_structure(params)
        return ids, params

    def _grpc_authorized(self, grpc_context) -> bool:
        """With an API key set, a call must carry the metadata ``authorization: Bearer <key>``;
        otherwise UNAUTHENTICATED."""
        if self.api_key and not authorized(
                dict(grpc_context.invocation_metadata()).get("authorization"), self.api_key):
            _grpc_status(grpc_context, grpc.StatusCode.UNAUTHENTICATED, "invalid or missing "
                         "API key: send the metadata 'authorization: Bearer <key>'")
            return False
        return True

    async def _grpc_chunks(self, req, grpc_context):
        """(chunk, stream) of one gRPC request. A failure sets the call's status (a bad request:
        INVALID_ARGUMENT; overload: RESOURCE_EXHAUSTED, the retry hint in the details, as
        Serve's gRPC path drops trailing metadata) and ends the iteration. Every call is
        counted by its status."""
        code = grpc.StatusCode.CANCELLED  # unless it ends here: the client went away
        try:
            if not self._grpc_authorized(grpc_context):
                code = grpc_context.code()
                return
            rid = f"grpc-{uuid.uuid4().hex}"  # the client's request_id is echoed, never a key
            try:
                if req.model and req.model != self.served_name:  # as HTTP's 404
                    raise UnknownModel(f"model {req.model!r} does not exist; this server "
                                       f"serves {self.served_name!r}")
                ids, params = await self._grpc_inputs(req)
                async with self.request(ids, params, rid) as stream:
                    async for chunk in stream.chunks(stream.deadline):
                        if chunk.finished:
                            await self.finish(stream)  # the replica's result: timing
                        yield chunk, stream
                code = grpc.StatusCode.OK
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                failure = describe(exc, rid)
                log_failure(failure, exc, rid)
                _grpc_status(grpc_context, failure.code, failure.message)
                code = failure.code
        finally:
            self.metrics.count_grpc(code)

    @staticmethod
    def _grpc_final(msg, stream: RequestStream) -> None:
        msg.finish_reason = stream.finish_reason or ""
        msg.usage.CopyFrom(baton_pb2.Usage(prompt_tokens=stream.num_prompt_tokens,
                                           completion_tokens=len(stream.token_ids),
                                           cached_tokens=stream.num_cached_tokens))
        t = stream.timing
        msg.ttft_s = t.first_token - t.received if t.first_token else 0.0

    async def Generate(self, request, grpc_context: RayServegRPCContext):
        resp = baton_pb2.GenerateResponse()
        async for chunk, stream in self._grpc_chunks(request, grpc_context):
            resp.request_id = request.request_id or stream.request_id
            resp.token_ids.extend(chunk.token_ids)
            resp.text += chunk.text
            resp.logprobs.extend(chunk.logprobs or [])
            resp.top_logprobs.extend(_grpc_top(chunk))
            if chunk.finished:
                self._grpc_final(resp, stream)
        return resp

    async def GenerateStream(self, request, grpc_context: RayServegRPCContext):
        sent = False
        async for chunk, stream in self._grpc_chunks(request, grpc_context):
            msg = baton_pb2.GenerateResponse(request_id=request.request_id or stream.request_id,
                                             token_ids=chunk.token_ids, text=chunk.text,
                                             logprobs=chunk.logprobs or [],
                                             top_logprobs=_grpc_top(chunk),
                                             produced_at=chunk.produced_at)
            if chunk.finished:
                self._grpc_final(msg, stream)
            sent = True
            yield msg
        if not sent and grpc_context.code() not in (None, grpc.StatusCode.OK) \
                and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
            # Serve's Python proxy (no HAProxy in front) carries a stream's status only with a
            # message or an exception: raise, with the status already set on the context.
            raise RuntimeError(grpc_context.details())

    async def Health(self, request, grpc_context: RayServegRPCContext = None):
        """As ``/health``: ``ok`` when a decode replica answers, ``unavailable`` (and the status
        UNAVAILABLE) when none does."""
        if await self.ready():
            return baton_pb2.HealthResponse(status="ok", model=self.served_name)
        if grpc_context is not None:
            grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
            grpc_context.set_details("no decode replica answers yet (starting, or being "
                                     "replaced)")
        return baton_pb2.HealthResponse(status="unavailable", model=self.served_name)
