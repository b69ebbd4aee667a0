"""The ingress: OpenAI-compatible HTTP (FastAPI through Serve) and gRPC, in one deployment.

Per request: validate → apply the chat template → tokenize → stream from the decode deployment
(which hands the prompt to a prefill replica) → SSE chunks, a JSON body, or gRPC messages.
Bad input is a 400 in OpenAI's error format (gRPC: INVALID_ARGUMENT); a request that cannot be
served in time ends with an error, never a silent hang.
"""


import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from decode_worker.server import GenerateRequest, TokenDelta
from engine import SamplingParams
from engine.loader import load_tokenizer, resolve_model
from proto import baton_pb2
from router.detok import IncrementalText
from router.metrics import RouterMetrics
from router.protocol import ChatCompletionRequest, CompletionRequest

app = FastAPI(title="Baton")


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "code": status}})


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


def _usage(final: TokenDelta) -> dict:
    return {"prompt_tokens": final.num_prompt_tokens,
            "completion_tokens": final.num_output_tokens,
            "total_tokens": final.num_prompt_tokens + final.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "kv_transfer": final.transfer}


def _fail(grpc_context, code, exc: Exception):
    """Set the status the client sees, then raise (the proxy keeps a status set before)."""
    grpc_context.set_code(code)
    grpc_context.set_details(str(exc))
    raise exc


def _grpc_usage(final: TokenDelta):
    return baton_pb2.Usage(prompt_tokens=final.num_prompt_tokens,
                           completion_tokens=final.num_output_tokens,
                           cached_tokens=final.num_cached_tokens)


class RequestTimeout(Exception):
    pass


@serve.deployment(name="Router", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
@serve.ingress(app)
class Router:
    def __init__(self, decode, model: str, served_name: str, max_model_len: int | None,
                 request_timeout_s: float = 300.0, default_max_tokens: int = 16):
        self.decode = decode
        source = resolve_model(model)
        self.tokenizer = load_tokenizer(source)
        self.vocab_size = source.config.vocab_size
        self.max_model_len = min(max_model_len or source.config.max_position_embeddings,
                                 source.config.max_position_embeddings)
        self.served_name = served_name
        self.timeout_s = request_timeout_s
        self.default_max_tokens = default_max_tokens
        self.metrics = RouterMetrics()

    # -- shared path ------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: model {self.served_name!r} has no tokenizer; send "
                                 "token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within the "
                             f"model's context of {self.max_model_len} tokens")
        return ids

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: model {self.served_name!r} has no chat template")
        ids = self.tokenizer.apply_chat_template([m.model_dump(exclude_none=True)
                                                  for m in body.messages],
                                                 add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return self.tokenize(list(ids))

    def check_stop_strings(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")

    async def run(self, ids: list[int], params: SamplingParams,
                  request_id: str) -> AsyncIterator[TokenDelta]:
        """Stream deltas from the decode deployment, with a deadline and metrics."""
        start = time.perf_counter()
        deadline = start + self.timeout_s
        last = None
        outcome = "error"
        self.metrics.in_flight.inc()
        stream = self.decode.options(stream=True).generate.remote(
            GenerateRequest(tuple(ids), params, request_id))
        try:
            while True:
                try:
                    delta = await asyncio.wait_for(stream.__anext__(), deadline - time.perf_counter())
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    outcome = "timeout"
                    raise RequestTimeout(f"request {request_id} was not served within "
                                         f"{self.timeout_s:.0f}s") from None
                now = time.perf_counter()
                if delta.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - start)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    self.metrics.tokens.inc(len(delta.token_ids))
                if delta.finished:
                    self.metrics.record_transfer(delta.transfer)
                    outcome = delta.finish_reason or "stop"
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            stream.cancel()
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()
            self.metrics.e2e.observe(time.perf_counter() - start)

    # -- HTTP -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.served_name, "object": "model",
                                            "owned_by": "baton", "created": 0}]}

    @app.get("/metrics")
    async def metrics_endpoint(self):
        try:
            self.metrics.set_kv(await asyncio.wait_for(self.decode.kv_load.remote(), 5))
        except Exception:  # noqa: BLE001 - serve the router's own metrics anyway
            pass
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        try:
            ids = self.tokenize(body.prompt)
            params = body.sampling_params(self.default_max_tokens, body.logprobs is not None)
            self.check_stop_strings(params)
        except ValueError as exc:
            return error_response(400, str(exc))
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(self._sse(ids, params, rid, "text_completion", body),
                                     media_type="text/event-stream")
        return await self._complete(ids, params, rid, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        try:
            ids = self.chat_ids(body)
            params = body.sampling_params(self.default_max_tokens, body.logprobs)
            self.check_stop_strings(params)
        except ValueError as exc:
            return error_response(400, str(exc))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(self._sse(ids, params, rid, "chat.completion.chunk", body),
                                     media_type="text/event-stream")
        return await self._complete(ids, params, rid, "chat.completion")

    async def _complete(self, ids, params, rid, kind: str):
        tokens, logprobs, final = [], [], None
        try:
            async for delta in self.run(ids, params, rid):
                tokens += delta.token_ids
                logprobs += delta.logprobs or []
                final = delta
        except ValueError as exc:
            return error_response(400, str(exc))
        except RequestTimeout as exc:
            return error_response(504, str(exc), "timeout")
        except Exception as exc:  # noqa: BLE001 - a failed replica or transfer
            return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")
        text = final.text if final.text is not None else ""
        choice = {"index": 0, "finish_reason": final.finish_reason, "token_ids": tokens}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["logprobs"] = ({"tokens": None, "token_logprobs": logprobs}
                                  if params.logprobs else None)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.served_name,
                "choices": [choice], "usage": _usage(final)}

    async def _sse(self, ids, params, rid, kind: str, body) -> AsyncIterator[str]:
        created = int(time.time())
        chat = kind == "chat.completion.chunk"
        detok = IncrementalText(self.tokenizer, params.stop) if self.tokenizer else None

        def chunk(text: str, token_ids, finish=None, logprobs=None, role=False) -> str:
            choice = {"index": 0, "finish_reason": finish, "token_ids": token_ids}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if role else \
                    {"content": text}
            else:
                choice["text"] = text
                choice["logprobs"] = {"token_logprobs": logprobs} if logprobs else None
            return _event({"id": rid, "object": kind, "created": created,
                           "model": self.served_name, "choices": [choice]})

        if chat:
            yield chunk("", [], role=True)
        final = None
        try:
            async for delta in self.run(ids, params, rid):
                if delta.finished:  # the engine's final text has its stop string cut
                    final = delta
                    text = detok.finish(delta.text or "") if detok else ""
                else:
                    text = detok.feed(delta.token_ids) if detok else ""
                yield chunk(text, delta.token_ids, delta.finish_reason if delta.finished else None,
                            delta.logprobs)
        except Exception as exc:  # noqa: BLE001 - the stream is open: report in-band
            status = 504 if isinstance(exc, RequestTimeout) else \
                400 if isinstance(exc, ValueError) else 500
            yield _event({"error": {"message": f"{exc}", "code": status}})
            yield "data: [DONE]\n\n"
            return
        include_usage = body.stream_options.include_usage if body.stream_options else True
        if include_usage and final is not None:
            yield _event({"id": rid, "object": kind, "created": created, "model": self.served_name,
                          "choices": [], "usage": _usage(final)})
        yield "data: [DONE]\n\n"


    # -- gRPC (Serve's gRPC proxy calls these by RPC name) ------------------------------------
    def _grpc_inputs(self, req) -> tuple[list[int], SamplingParams]:
        if req.prompt and req.prompt_token_ids:
            raise ValueError("prompt: give either prompt or prompt_token_ids, not both")
        ids = self.tokenize(req.prompt if req.prompt else list(req.prompt_token_ids))
        fields = {name: getattr(req, name) for name in ("max_tokens", "temperature", "top_p",
                                                        "top_k", "seed") if req.HasField(name)}
        fields.setdefault("max_tokens", self.default_max_tokens)
        params = SamplingParams(stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
                                ignore_eos=req.ignore_eos, logprobs=req.logprobs, **fields)
        self.check_stop_strings(params)
        return ids, params

    async def _grpc_deltas(self, req, grpc_context):
        """Validated deltas of one gRPC request; a bad request sets INVALID_ARGUMENT instead."""
        try:
            ids, params = self._grpc_inputs(req)
        except ValueError as exc:
            _fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        detok = IncrementalText(self.tokenizer, params.stop) if self.tokenizer else None
        start = time.perf_counter()
        try:
            async for delta in self.run(ids, params, req.request_id or f"grpc-{uuid.uuid4().hex}"):
                if delta.finished:
                    text = detok.finish(delta.text or "") if detok else ""
                else:
                    text = detok.feed(delta.token_ids) if detok else ""
                yield delta, text, time.perf_counter() - start
        except ValueError as exc:
            _fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except RequestTimeout as exc:
            _fail(grpc_context, grpc.StatusCode.DEADLINE_EXCEEDED, exc)

    async def Generate(self, request, grpc_context: RayServegRPCContext):
        resp = baton_pb2.GenerateResponse()
        ttft = None
        async for delta, text, elapsed in self._grpc_deltas(request, grpc_context):
            ttft = elapsed if ttft is None else ttft
            resp.request_id = delta.request_id
            resp.token_ids.extend(delta.token_ids)
            resp.text += text
            resp.logprobs.extend(delta.logprobs or [])
            if delta.finished:
                resp.finish_reason = delta.finish_reason or ""
                resp.usage.CopyFrom(_grpc_usage(delta))
                resp.ttft_s = ttft
        return resp

    async def GenerateStream(self, request, grpc_context: RayServegRPCContext):
        ttft = None
        async for delta, text, elapsed in self._grpc_deltas(request, grpc_context):
            ttft = elapsed if ttft is None else ttft
            msg = baton_pb2.GenerateResponse(request_id=delta.request_id,
                                             token_ids=delta.token_ids, text=text,
                                             logprobs=delta.logprobs or [])
            if delta.finished:
                msg.finish_reason = delta.finish_reason or ""
                msg.usage.CopyFrom(_grpc_usage(delta))
                msg.ttft_s = ttft
            yield msg

    async def Health(self, request, grpc_context: RayServegRPCContext = None):
        return baton_pb2.HealthResponse(status="ok", model=self.served_name)
