"""The gRPC adapter of the ingress (``proto/baton.proto``): a ``GenerateRequest`` is read into the
same request model as HTTP's ``/v1/completions`` (:class:`~router.ingress.protocol.
CompletionRequest`), so every option and every check exists once and both protocols give the
same errors (``INVALID_ARGUMENT`` for HTTP's 400, ``NOT_FOUND`` for its 404, ...); the service's
chunks become ``GenerateResponse`` messages (one builder, :func:`chunk_message`, for the streamed
messages and the parts of a whole answer). The adapter holds the request service and only
translates.
"""

from __future__ import annotations

import json
import os
import uuid

import grpc
from ray.serve.grpc_util import RayServegRPCContext

from proto import baton_pb2
from proto.servicer import Unparsed
from engine.errors import BadRequest
from router.ingress.door import authorized
from router.ingress.errors import describe, log_failure
from router.ingress.protocol import CompletionRequest
from router.ingress.service import RequestService, timing_of
from router.ingress.streams import Chunk, RequestStream


def _grpc_status(grpc_context, code, message: str) -> None:
    """The status the client sees. The handler then returns normally (Serve sends a status set on
    the context; a raised exception would also be logged with its traceback)."""
    grpc_context.set_code(code)
    grpc_context.set_details(message)


# GenerateRequest's optional sampling fields, passed on when set (the service's defaults if not).
_GRPC_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")


def completion_request(req) -> CompletionRequest:
    """A ``GenerateRequest`` as the body of HTTP's ``/v1/completions``: the same model, the same
    checks, the same messages (``BadRequest``/``ValidationError`` on bad input)."""
    if req.prompt and req.prompt_token_ids:
        raise BadRequest("prompt: give either prompt or prompt_token_ids, not both")
    if req.HasField("top_logprobs") and not req.logprobs:
        raise BadRequest("top_logprobs: needs logprobs=true")
    body = {name: getattr(req, name) for name in _GRPC_OPTIONAL if req.HasField(name)}
    if req.HasField("n"):
        body["n"] = req.n
    if req.priority:
        body["priority"] = req.priority
    if req.HasField("prompt_logprobs"):
        body["prompt_logprobs"] = req.prompt_logprobs
    body.update(prompt=req.prompt or list(req.prompt_token_ids), model=req.model or None,
                stop=list(req.stop) or None, stop_token_ids=list(req.stop_token_ids) or None,
                ignore_eos=req.ignore_eos,
                logprobs=(req.top_logprobs if req.HasField("top_logprobs") else 0)
                if req.logprobs else None,
                logit_bias={str(k): v for k, v in req.logit_bias.items()} or None)
    which, structured = req.WhichOneof("structured_output"), {}
    if which == "json_object":
        if req.json_object:
            body["response_format"] = {"type": "json_object"}
    elif which == "json_schema":
        structured["json"] = req.json_schema
    elif which == "choice":
        structured["choice"] = list(req.choice.options)
    elif which is not None:  # regex, grammar
        structured[which] = getattr(req, which)
    if req.disable_any_whitespace:
        structured["disable_any_whitespace"] = True
    if structured:
        body["structured_outputs"] = structured
    return CompletionRequest.model_validate(body)


def _grpc_top(chunk: Chunk) -> list:
    return [baton_pb2.TopLogprobs(token_ids=[t for t, _ in alts], logprobs=[lp for _, lp in alts])
            for alts in chunk.top_logprobs or ()]


def _grpc_prompt(msg, stream: RequestStream) -> None:
    """A sequence's prompt logprobs (asked with ``prompt_logprobs``), from the second token."""
    if stream.prompt_logprobs is None:
        return
    rest = stream.prompt_logprobs[1:]
    msg.prompt_logprobs.extend(lp for lp, _ in rest)
    msg.prompt_top_logprobs.extend(
        baton_pb2.TopLogprobs(token_ids=[t for t, _ in alts], logprobs=[v for _, v in alts])
        for _, alts in rest)


def _grpc_final(msg, stream: RequestStream) -> None:
    msg.finish_reason = stream.finish_reason or ""
    msg.usage.CopyFrom(baton_pb2.Usage(prompt_tokens=stream.num_prompt_tokens,
                                       completion_tokens=len(stream.token_ids),
                                       cached_tokens=stream.num_cached_tokens))
    t = stream.timing
    msg.ttft_s = t.first_token - t.received if t.first_token else 0.0


def chunk_message(request, index: int, chunk: Chunk, stream: RequestStream,
                  first: bool) -> baton_pb2.GenerateResponse:
    """Sequence ``index``'s chunk as a message: its tokens, text and logprobs; with its first
    chunk the prompt logprobs, with its last the finish reason, usage and time to first token."""
    msg = baton_pb2.GenerateResponse(request_id=request.request_id or stream.request_id,
                                     token_ids=chunk.token_ids, text=chunk.text,
                                     logprobs=chunk.logprobs or [],
                                     top_logprobs=_grpc_top(chunk),
                                     produced_at=chunk.produced_at, index=index)
    if first:
        _grpc_prompt(msg, stream)
    if chunk.finished:
        _grpc_final(msg, stream)
    return msg


def _append(whole: baton_pb2.GenerateResponse, part: baton_pb2.GenerateResponse) -> None:
    """A sequence's whole answer, one chunk's message longer."""
    whole.token_ids.extend(part.token_ids)
    whole.text += part.text
    whole.logprobs.extend(part.logprobs)
    whole.top_logprobs.extend(part.top_logprobs)
    if part.HasField("usage"):  # its last chunk
        whole.finish_reason, whole.ttft_s = part.finish_reason, part.ttft_s
        whole.usage.CopyFrom(part.usage)


def _timing_asked(request) -> dict | None:
    """Where a request that asked for its timeline gets it (``None``: not asked, or a message
    that did not parse, whose failure :meth:`GrpcAdapter._chunks` reports)."""
    return {} if not isinstance(request, Unparsed) and request.include_timing else None


class GrpcAdapter:
    """The gRPC methods of the ingress, over its request service (the deployment class declares
    them by RPC name, :mod:`.app`, and calls these)."""

    def __init__(self, service: RequestService):
        self.service = service

    async def _inputs(self, req):
        """The request's prompt ids and parameters, read as HTTP reads a completion's body."""
        if isinstance(req, Unparsed):  # proto.servicer: the message did not parse
            raise BadRequest(req.reason)
        body = completion_request(req)
        self.service.check_model(body.model)
        batch, params, _ = await self.service.checked_inputs(self.service.completion_inputs,
                                                             body)
        return batch[0], params

    def _authorized(self, grpc_context) -> bool:
        """With an API key set, a call must carry the metadata ``authorization: Bearer <key>``;
        otherwise UNAUTHENTICATED."""
        key = self.service.api_key
        if key and not authorized(dict(grpc_context.invocation_metadata()).get("authorization"),
                                  key):
            _grpc_status(grpc_context, grpc.StatusCode.UNAUTHENTICATED, "invalid or missing "
                         "API key: send the metadata 'authorization: Bearer <key>'")
            return False
        return True

    async def _chunks(self, req, grpc_context, timed: dict | None = None):
        """(index, chunk, stream) of one gRPC request's ``n`` sequences, as they come. A failure
        sets the call's status (a bad request: INVALID_ARGUMENT; overload: RESOURCE_EXHAUSTED,
        the retry hint in the details, as Serve's gRPC path drops trailing metadata) and ends
        the iteration. Every call is counted by its status. Given ``timed``, a request of one
        sequence that ended puts its timeline there (``"timing"``, as HTTP's ``usage.timing``)."""
        code = grpc.StatusCode.CANCELLED  # unless it ends here: the client went away
        try:
            if not self._authorized(grpc_context):
                code = grpc_context.code()
                return
            rid = f"grpc-{uuid.uuid4().hex}"  # the client's request_id is echoed, never a key
            try:
                ids, params = await self._inputs(req)
                feed = self.service.feed([ids], params, rid)
                try:
                    async for index, chunk in feed:
                        yield index, chunk, feed.streams[index]
                finally:
                    await feed.aclose()
                if timed is not None and len(feed.streams) == 1:
                    timed["timing"] = timing_of(feed.streams[0], feed.results[0],
                                                self.service.replica)
                    timed["request_id"] = req.request_id or feed.streams[0].request_id
                code = grpc.StatusCode.OK
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                failure = describe(exc, rid)
                log_failure(failure, exc, rid)
                _grpc_status(grpc_context, failure.code, failure.message)
                code = failure.code
        finally:
            self.service.metrics.count_grpc(code)

    async def generate(self, request, grpc_context: RayServegRPCContext):
        """The whole answer; with ``n`` > 1 every sequence in ``choices`` (and sequence 0 in the
        top-level fields)."""
        answers: dict[int, baton_pb2.GenerateResponse] = {}
        timed = _timing_asked(request)
        async for index, chunk, stream in self._chunks(request, grpc_context, timed):
            part = chunk_message(request, index, chunk, stream, index not in answers)
            if index not in answers:
                answers[index] = baton_pb2.GenerateResponse(index=index)
                answers[index].prompt_logprobs.extend(part.prompt_logprobs)
                answers[index].prompt_top_logprobs.extend(part.prompt_top_logprobs)
            answers[index].request_id = part.request_id
            _append(answers[index], part)
        if not answers:
            return baton_pb2.GenerateResponse()
        choices = [answers[i] for i in sorted(answers)]
        first = baton_pb2.GenerateResponse()
        first.CopyFrom(choices[0])
        if len(choices) > 1:  # sequence i ran as "<id>-<i>": the request's own id on top
            first.choices.extend(choices)
            first.request_id = request.request_id or choices[0].request_id.rsplit("-", 1)[0]
        if timed:
            first.timing_json = json.dumps(timed["timing"])
        return first

    async def generate_stream(self, request, grpc_context: RayServegRPCContext):
        sent, started = False, set()
        timed = _timing_asked(request)
        async for index, chunk, stream in self._chunks(request, grpc_context, timed):
            yield chunk_message(request, index, chunk, stream, index not in started)
            started.add(index)
            sent = True
        if timed:  # after the last message, as HTTP's usage event: the replicas' results are in
            yield baton_pb2.GenerateResponse(request_id=timed["request_id"],
                                             timing_json=json.dumps(timed["timing"]))
        if not sent and grpc_context.code() not in (None, grpc.StatusCode.OK) \
                and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
            # Serve's Python proxy (no HAProxy in front) carries a stream's status only with a
            # message or an exception: raise, with the status already set on the context.
            raise RuntimeError(grpc_context.details())

    async def health(self, request, grpc_context: RayServegRPCContext = None):
        """As ``/health``: ``ok`` when a decode replica answers, ``unavailable`` (and the status
        UNAVAILABLE) when none does."""
        served = self.service.served_name
        if await self.service.ready():
            return baton_pb2.HealthResponse(status="ok", model=served)
        if grpc_context is not None:
            grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
            grpc_context.set_details("no decode replica answers yet (starting, or being "
                                     "replaced)")
        return baton_pb2.HealthResponse(status="unavailable", model=served)
