"""The OpenAI-compatible HTTP adapter of the ingress (FastAPI through Serve): the wire's JSON to
the request service's inputs, its chunks to SSE events or a JSON body, its errors to OpenAI's
error format. Validation and the request's life are the service's (:mod:`.service`).
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
from router.ingress.door import APIKeyMiddleware, BodyLimitMiddleware, StatusCountMiddleware
from router.ingress.errors import UnknownModel, describe, log_failure, validation_message
from router.ingress.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, TokenizeRequest)
from router.ingress.service import Merged, timing_of, usage_of
from router.ingress.streams import Chunk, RequestStream

app = FastAPI(title="Baton")
TEXT, CHAT = "text_completion", "chat.completion"  # the two endpoints' answer objects
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


class HttpAdapter:
    """What the HTTP routes of the ingress deployment do (a mixin over :class:`RequestService`;
    the routes themselves are declared on the deployment class, :mod:`.app`: FastAPI's
    class-based views through Serve bind ``self`` only on methods of that class)."""

    def configure_http(self) -> None:
        """The door's settings for this replica (the middlewares read them per request)."""
        APIKeyMiddleware.key = self.api_key
        BodyLimitMiddleware.max_bytes = self.max_request_bytes
        StatusCountMiddleware.count = self.metrics.count_http

    async def http_health(self):
        """Ready: 200 once a decode replica answers (so the app can serve a request), else 503
        (Serve still starting or replacing them). ``/livez`` is this replica alone."""
        if await self.ready():
            return {"status": "ok"}
        return JSONResponse(status_code=503, content={"status": "unavailable", "message":
                            "no decode replica answers yet (starting, or being replaced)"})

    def _unknown_model(self, name: str | None) -> JSONResponse | None:
        """A 404 for a model this app does not serve (as OpenAI and vLLM answer)."""
        try:
            self.check_model(name)
        except UnknownModel as exc:
            return JSONResponse(status_code=404, content={"error": {
                "message": str(exc), "type": "not_found_error", "param": "model",
                "code": "model_not_found"}})
        return None

    async def http_models(self):
        return {"object": "list", "data": [self.model_card()]}

    async def http_model(self, model_id: str):
        return self._unknown_model(model_id) or self.model_card()

    async def http_metrics(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_tokenize(self, body: TokenizeRequest):
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

    async def http_detokenize(self, body: DetokenizeRequest):
        if (missing := self._unknown_model(body.model)) is not None:
            return missing
        if self.tokenizer is None:
            return error_response(400, f"model {self.served_name!r} has no tokenizer")
        try:
            self.checks.in_vocabulary(body.tokens, "tokens")
            return {"prompt": self.tokenizer.decode(body.tokens)}
        except ValueError as exc:
            return error_for(exc, "detokenize")

    async def http_completions(self, body: CompletionRequest):
        return await self._generate(body, TEXT, self._completion_inputs)

    async def http_chat(self, body: ChatCompletionRequest):
        return await self._generate(body, CHAT, self._chat_inputs)

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
            batch, params, echo = await self.checked_inputs(inputs, body)
        except ValueError as exc:
            return error_for(exc, rid)
        if body.stream:
            return DeferredStreamingResponse(self._sse(batch, params, rid, kind, body, echo),
                                             media_type="text/event-stream")
        return await self._complete(batch, params, rid, kind, body, echo)

    def _parsing(self, body) -> tuple[bool, bool]:
        """(reasoning, tools): what a chat answer's text is split into."""
        return self.reasoning_parser == "qwen3", body.tool_mode != "none"

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
                if echo and shown:  # the echoed prompt's tokens first, with their logprobs
                    lp = self._with_prompt(lp, stream, params)
                if body.prompt_logprobs is not None and stream.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.texts.prompt_field(
                        stream.prompt_token_ids, stream.prompt_logprobs)
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

    def _with_prompt(self, lp: dict, stream: RequestStream, params: SamplingParams) -> dict:
        """A completion's logprobs object behind its echoed prompt's."""
        if stream.prompt_logprobs is None:
            return lp
        head, _ = self.texts.echoed(stream.prompt_token_ids, stream.prompt_logprobs,
                                    bool(params.logprobs))
        top = head["top_logprobs"] + lp["top_logprobs"] if head["top_logprobs"] is not None \
            else None
        return {key: head[key] + lp[key] for key in ("tokens", "token_logprobs", "text_offset")} \
            | {"top_logprobs": top}

    def _usage(self, feed: Merged, params: SamplingParams, timed: bool) -> dict:
        """The answer's usage, with the request's timeline when asked (one sequence only)."""
        usage = usage_of(feed.streams, feed.results, params.num_sequences)
        if timed and len(feed.streams) == 1:
            usage["timing"] = timing_of(feed.streams[0], feed.results[0], self.replica)
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
            first = index not in started
            if shown and chunk.token_ids:
                lp, offsets[index] = self._logprobs(chat, chunk, offsets[index])
                if echo and first and not chat:
                    lp = self._with_prompt(lp, feed.streams[index], params)
            if first and body.prompt_logprobs is not None and \
                    feed.streams[index].prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.texts.prompt_field(
                    feed.streams[index].prompt_token_ids, feed.streams[index].prompt_logprobs)
            if chat:
                splitter = splitters[index]
                parts = splitter.feed(chunk.text) + (splitter.finish() if chunk.finished else [])
                delta = {}
                for part, text in parts:
                    delta[part] = delta.get(part, "") + text
                if calls := splitter.take_calls():  # as they are generated
                    delta["tool_calls"] = calls
                if splitter.tool_calls and chunk.finish_reason == "stop":
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
