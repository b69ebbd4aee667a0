"""The OpenAI-compatible HTTP adapter of the ingress (FastAPI through Serve): the wire's JSON to
the request service's inputs, its chunks to SSE events or a JSON body, its errors to OpenAI's
error format. Validation and the request's life are the service's (:mod:`.service`); the
adapter holds one and only translates. A request's choices are written by one builder per
request kind (:class:`TextChoices`, :class:`ChatChoices`), whole or streamed.
"""


import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.sampling_params import SamplingParams, best_indices
from router.ingress.chat import StreamSplitter, split_message
from router.ingress.door import (APIKeyMiddleware, BodyLimitMiddleware, OpenRequestsMiddleware,
                                 StatusCountMiddleware, replay)
from router.ingress.errors import UnknownModel, describe, log_failure, validation_message
from router.ingress.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, TokenizeRequest)
from router.ingress.service import Merged, RequestService, timing_of, usage_of
from router.ingress.streams import Chunk, RequestStream


class GenerationFastPath:
    """``POST /v1/completions`` and ``/v1/chat/completions`` straight to the adapter, past
    FastAPI's per-request machinery (its routing, dependency solving and exception layers): the
    body is read, parsed with ``json`` and validated with the route's pydantic model, as FastAPI
    does, and the adapter's answer sent. Only a body that parses and validates takes this path;
    any other (not JSON, no content type, a JSON or validation error) is handed to FastAPI with
    its body replayed, so every refusal is FastAPI's own. The routes stay declared on the
    deployment (OpenAPI; the path taken while no replica set ``adapter``). Innermost of the
    middlewares: the door's run first. ``router.http_fast_path: false`` turns it off."""

    adapter = None  # the replica's HttpAdapter, once it starts (and the path is on)
    ROUTES = {"/v1/completions": (CompletionRequest, "completions"),
              "/v1/chat/completions": (ChatCompletionRequest, "chat")}

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        route = self.ROUTES.get(_route_path(scope)) if scope["type"] == "http" \
            and scope["method"] == "POST" and self.adapter is not None else None
        if route is None or not _json_content(scope):
            await self.app(scope, receive, send)
            return
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was whole
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(body)
        model, method = route
        try:
            request = model.model_validate(json.loads(raw))
        except Exception:  # noqa: BLE001 - FastAPI answers it, as without this path
            await self.app(scope, replay(raw, receive), send)
            return
        response = await getattr(self.adapter, method)(request)
        if not isinstance(response, Response):
            response = JSONResponse(response)
        await response(scope, receive, send)


def _route_path(scope) -> str:
    """The path below the app's root, as Starlette routes it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] == "/":
        return path[len(root):]
    return path


def _json_content(scope) -> bool:
    """A JSON content type (``application/json`` or ``application/*+json``), as FastAPI reads
    one; a body without a content type is left to FastAPI."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.decode("latin-1").partition(";")[0].strip().lower()
            main, _, sub = kind.partition("/")
            return main == "application" and (sub == "json" or sub.endswith("+json"))
    return False


app = FastAPI(title="Baton")
TEXT, CHAT = "text_completion", "chat.completion"  # the two endpoints' answer objects
# The last added runs first: the key is checked before any of the body is read.
app.add_middleware(GenerationFastPath)
app.add_middleware(OpenRequestsMiddleware)
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
    return error_response(400, validation_message(exc.errors()))


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
    400 with its headers), not with a 200 and an in-band error.

    It runs in the request's own task, with no listener for the client's disconnect beside it
    (Starlette starts both, in a task group, where the server is of ASGI spec before 2.4, as
    uvicorn's 2.3 is): Serve watches for the disconnect itself and cancels the request's task
    (its direct ingress, or its proxy's call), which stops the stream. That saves a task group
    and a task a stream (~55 us on the development machine, in a loop)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.background is not None:
            await super().__call__(scope, receive, send)
            return
        await self.stream_response(send)

    async def stream_response(self, send) -> None:
        try:
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
                await send({"type": "http.response.body", "body": chunk.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:  # cancelled in a send (a slow client): the body's own finally runs now
            if (aclose := getattr(self.body_iterator, "aclose", None)) is not None:
                await aclose()


async def _send_whole(response: Response, send) -> None:
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


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


class Choices:
    """How one request's choices are written: :meth:`whole` for a JSON answer, :meth:`delta`
    for each streamed chunk of sequence ``index`` (streaming runs ``n`` sequences per prompt,
    so sequence ``index`` is choice ``index``). The prompt logprobs go with a choice's first
    part."""

    kind = ""  # the answer's ``object``

    def __init__(self, service: RequestService, body, params: SamplingParams, echo):
        self.texts = service.texts
        self.body, self.params, self.echo = body, params, echo
        self.shown = params.logprobs is not None
        self.started: set[int] = set()  # streamed sequences that have sent a part

    def _choice(self, index: int, finish_reason, token_ids, stream: RequestStream,
                first: bool) -> dict:
        choice = {"index": index, "finish_reason": finish_reason, "token_ids": token_ids}
        if first and self.body.prompt_logprobs is not None and stream.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.texts.prompt_field(stream.prompt_token_ids,
                                                                stream.prompt_logprobs)
        return choice

    def _first(self, index: int) -> bool:
        first = index not in self.started
        self.started.add(index)
        return first

    def opening(self, index: int) -> dict | None:
        """A part to send before sequence ``index``'s first (chat: the assistant's role)."""
        return None


class TextChoices(Choices):
    """``/v1/completions``: the text (behind the echoed prompt), completions logprobs."""

    kind = TEXT

    def __init__(self, service, body, params, echo):
        super().__init__(service, body, params, echo)
        self.offsets: dict[int, int] = {}  # a streamed sequence's text offset so far

    def whole(self, index: int, stream: RequestStream, prompt: int, text: str) -> dict:
        head = self.echo[prompt] if self.echo else ""
        choice = self._choice(index, stream.finish_reason, stream.token_ids, stream, True)
        lp = None
        if self.shown:
            lp, _ = self.texts.completion(stream.token_ids, stream.logprobs,
                                          stream.top_logprobs, len(head))
            if self.echo:
                lp = self._with_prompt(lp, stream)
        choice["text"] = head + text
        choice["logprobs"] = lp
        return choice

    def delta(self, index: int, chunk: Chunk, stream: RequestStream) -> dict:
        first = self._first(index)
        choice = self._choice(index, chunk.finish_reason, chunk.token_ids, stream, first)
        head = self.echo[index // self.params.n] if self.echo else ""
        lp = None
        if self.shown and chunk.token_ids:
            offset = self.offsets.get(index, len(head))
            lp, self.offsets[index] = self.texts.completion(
                chunk.token_ids, chunk.logprobs, chunk.top_logprobs, offset)
            if self.echo and first:
                lp = self._with_prompt(lp, stream)
        choice["text"] = (head if first else "") + chunk.text
        choice["logprobs"] = lp
        return choice

    def _with_prompt(self, lp: dict, stream: RequestStream) -> dict:
        """A completion's logprobs object behind its echoed prompt's."""
        if stream.prompt_logprobs is None:
            return lp
        head, _ = self.texts.echoed(stream.prompt_token_ids, stream.prompt_logprobs,
                                    bool(self.params.logprobs))
        top = head["top_logprobs"] + lp["top_logprobs"] if head["top_logprobs"] is not None \
            else None
        return {key: head[key] + lp[key] for key in ("tokens", "token_logprobs", "text_offset")} \
            | {"top_logprobs": top}


class ChatChoices(Choices):
    """``/v1/chat/completions``: the message (reasoning apart, tool calls parsed; streamed, as
    they are generated), chat logprobs."""

    kind = CHAT

    def __init__(self, service, body, params, echo):
        super().__init__(service, body, params, echo)
        self.parsing = service.reasoning_parser == "qwen3", body.tool_mode != "none"
        self.splitters: dict[int, StreamSplitter] = {}

    def _logprobs(self, part) -> dict | None:
        return self.texts.chat(part.token_ids, part.logprobs, part.top_logprobs) \
            if self.shown else None

    def whole(self, index: int, stream: RequestStream, prompt: int, text: str) -> dict:
        choice = self._choice(index, stream.finish_reason, stream.token_ids, stream, True)
        choice["message"] = _message(text, self.parsing)
        if choice["message"].get("tool_calls") and stream.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"
        choice["logprobs"] = self._logprobs(stream)
        return choice

    def opening(self, index: int) -> dict | None:
        if index in self.started:
            return None
        return {"index": index, "finish_reason": None, "token_ids": [],
                "delta": {"role": "assistant", "content": ""}, "logprobs": None}

    def delta(self, index: int, chunk: Chunk, stream: RequestStream) -> dict:
        choice = self._choice(index, chunk.finish_reason, chunk.token_ids, stream,
                              self._first(index))
        splitter = self.splitters.setdefault(index, StreamSplitter(*self.parsing))
        parts = splitter.feed(chunk.text) + (splitter.finish() if chunk.finished else [])
        delta = {}
        for part, text in parts:
            delta[part] = delta.get(part, "") + text
        if calls := splitter.take_calls():  # as they are generated
            delta["tool_calls"] = calls
        if splitter.tool_calls and chunk.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"
        choice["delta"] = delta or {"content": ""}
        choice["logprobs"] = self._logprobs(chunk) if chunk.token_ids else None
        return choice


class HttpAdapter:
    """What the HTTP routes of the ingress deployment do, over its request service (the routes
    themselves are declared on the deployment class, :mod:`.app`: FastAPI's class-based views
    through Serve bind ``self`` only on methods of that class)."""

    def __init__(self, service: RequestService):
        self.service = service
        # The door's settings for this replica (the middlewares read them per request).
        APIKeyMiddleware.key = service.api_key
        BodyLimitMiddleware.max_bytes = service.max_request_bytes
        StatusCountMiddleware.count = service.metrics.count_http
        OpenRequestsMiddleware.limit = service.open_limit
        OpenRequestsMiddleware.retry_after_s = service.retry_after_s
        GenerationFastPath.adapter = self if service.http_fast_path else None

    async def health(self):
        """Ready: 200 once a decode replica answers (so the app can serve a request), else 503
        (Serve still starting or replacing them). ``/livez`` is this replica alone."""
        if await self.service.ready():
            return {"status": "ok"}
        return JSONResponse(status_code=503, content={"status": "unavailable", "message":
                            "no decode replica answers yet (starting, or being replaced)"})

    def _unknown_model(self, name: str | None) -> JSONResponse | None:
        """A 404 for a model this app does not serve (as OpenAI and vLLM answer)."""
        try:
            self.service.check_model(name)
        except UnknownModel as exc:
            return JSONResponse(status_code=404, content={"error": {
                "message": str(exc), "type": "not_found_error", "param": "model",
                "code": "model_not_found"}})
        return None

    async def models(self):
        return {"object": "list", "data": [self.service.model_card()]}

    async def model(self, model_id: str):
        return self._unknown_model(model_id) or self.service.model_card()

    async def metrics(self):
        return Response(self.service.metrics.render(), media_type="text/plain; version=0.0.4")

    async def tokenize(self, body: TokenizeRequest):
        """Token ids of a text or of chat messages, as the completions would see them."""
        svc = self.service
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        if svc.prompts is None:
            return error_response(400, f"model {svc.served_name!r} has no tokenizer")
        try:
            if body.prompt is not None:
                ids = await svc.prompts.encode(body.prompt)
            else:
                ids = await svc.prompts.render_chat(
                    [m.for_template() for m in body.messages], body.add_generation_prompt)
        except ValueError as exc:
            return error_for(exc, "tokenize")
        return {"count": len(ids), "max_model_len": svc.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest):
        svc = self.service
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        if svc.tokenizer is None:
            return error_response(400, f"model {svc.served_name!r} has no tokenizer")
        try:
            svc.checks.in_vocabulary(body.tokens, "tokens")
            return {"prompt": svc.tokenizer.decode(body.tokens)}
        except ValueError as exc:
            return error_for(exc, "detokenize")

    async def completions(self, body: CompletionRequest):
        return await self._generate(body, TextChoices, self.service.completion_inputs)

    async def chat(self, body: ChatCompletionRequest):
        return await self._generate(body, ChatChoices, self.service.chat_inputs)

    async def _generate(self, body, choices: type[Choices], inputs):
        """What both endpoints share. ``inputs(body)`` gives ``(batch, params, echo)``:
        ``batch`` the prompts' token ids, each prompt getting ``n`` choices (``index`` =
        prompt × n + choice) from ``n`` sequences, or the best ``n`` of ``best_of``; ``echo``
        each prompt's text, to put before its completions (or None). A bad request is a 400
        before any replica sees it; then an SSE stream or a whole answer."""
        rid = f"{'chatcmpl' if choices is ChatChoices else 'cmpl'}-{uuid.uuid4().hex}"
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        try:
            batch, params, echo = await self.service.checked_inputs(inputs, body)
        except ValueError as exc:
            return error_for(exc, rid)
        build = choices(self.service, body, params, echo)
        if body.stream:
            return DeferredStreamingResponse(self._sse(batch, params, rid, build),
                                             media_type="text/event-stream")
        return await self._complete(batch, params, rid, build)

    async def _complete(self, batch, params: SamplingParams, rid: str, build: Choices):
        feed = self.service.feed(batch, params, rid)
        texts = [[] for _ in feed.items]
        try:
            async for index, chunk in feed:
                texts[index].append(chunk.text)
        except Exception as exc:  # noqa: BLE001 - a bad request, overload, a failed replica
            return error_for(exc, rid)
        finally:
            await feed.aclose()
        k = params.num_sequences
        choices = []
        for p in range(len(batch)):
            group = feed.streams[p * k:(p + 1) * k]
            picked = best_indices(params, [sum(s.logprobs or ()) for s in group])
            choices += [build.whole(p * params.n + j, group[g], p, "".join(texts[p * k + g]))
                        for j, g in enumerate(picked)]
        return {"id": rid, "object": build.kind, "created": int(time.time()),
                "model": self.service.served_name, "choices": choices,
                "usage": self._usage(feed, params, build.body.include_timing)}

    def _usage(self, feed: Merged, params: SamplingParams, timed: bool) -> dict:
        """The answer's usage, with the request's timeline when asked (one sequence only)."""
        usage = usage_of(feed.streams, feed.results, params.num_sequences)
        if timed and len(feed.streams) == 1:
            usage["timing"] = timing_of(feed.streams[0], feed.results[0], self.service.replica)
        return usage

    async def _sse(self, batch, params: SamplingParams, rid: str,
                   build: Choices) -> AsyncIterator[str]:
        options = build.body.stream_options
        timed = options is not None and options.include_timing
        head = {"id": rid, "object": f"{build.kind}.chunk" if build.kind == CHAT else build.kind,
                "created": int(time.time()), "model": self.service.served_name}
        feed = self.service.feed(batch, params, rid)  # streaming: best_of is n
        sent = False
        try:
            async for index, chunk in feed:
                if (opening := build.opening(index)) is not None:
                    yield _event({**head, "choices": [opening]})
                sent = True
                obj = {**head, "choices": [build.delta(index, chunk, feed.streams[index])]}
                if timed:
                    obj["produced_at"] = chunk.produced_at
                yield _event(obj)
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
