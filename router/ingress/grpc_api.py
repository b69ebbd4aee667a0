"""The gRPC adapter of the ingress (``proto/baton.proto``): a ``GenerateRequest`` is read into the
same request model as HTTP's ``/v1/completions`` (:class:`~router.ingress.protocol.
CompletionRequest`), so every option and every check exists once and both protocols give the
same errors (``INVALID_ARGUMENT`` for HTTP's 400, ``NOT_FOUND`` for its 404, ...); the service's
chunks become ``GenerateResponse`` messages.
"""

from __future__ import annotations

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


class GrpcAdapter:
    """The gRPC methods of the ingress deployment (a mixin over :class:`RequestService`; Serve
    calls them by RPC name)."""

    async def _grpc_inputs(self, req):
        """The request's prompt ids and parameters, read as HTTP reads a completion's body."""
        if isinstance(req, Unparsed):  # proto.servicer: the message did not parse
            raise BadRequest(req.reason)
        body = completion_request(req)
        self.check_model(body.model)
        batch, params, _ = await self.checked_inputs(self._completion_inputs, body)
        return batch[0], params

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
        """(index, chunk, stream) of one gRPC request's ``n`` sequences, as they come. A failure
        sets the call's status (a bad request: INVALID_ARGUMENT; overload: RESOURCE_EXHAUSTED,
        the retry hint in the details, as Serve's gRPC path drops trailing metadata) and ends
        the iteration. Every call is counted by its status."""
        code = grpc.StatusCode.CANCELLED  # unless it ends here: the client went away
        try:
            if not self._grpc_authorized(grpc_context):
                code = grpc_context.code()
                return
            rid = f"grpc-{uuid.uuid4().hex}"  # the client's request_id is echoed, never a key
            try:
                ids, params = await self._grpc_inputs(req)
                feed = self._feed([ids], params, rid)
                try:
                    async for index, chunk in feed:
                        yield index, chunk, feed.streams[index]
                finally:
                    await feed.aclose()
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
        """The whole answer; with ``n`` > 1 every sequence in ``choices`` (and sequence 0 in the
        top-level fields)."""
        answers: dict[int, baton_pb2.GenerateResponse] = {}
        async for index, chunk, stream in self._grpc_chunks(request, grpc_context):
            if index not in answers:
                answers[index] = baton_pb2.GenerateResponse(index=index)
                _grpc_prompt(answers[index], stream)
            resp = answers[index]
            resp.request_id = request.request_id or stream.request_id
            resp.token_ids.extend(chunk.token_ids)
            resp.text += chunk.text
            resp.logprobs.extend(chunk.logprobs or [])
            resp.top_logprobs.extend(_grpc_top(chunk))
            if chunk.finished:
                self._grpc_final(resp, stream)
        if not answers:
            return baton_pb2.GenerateResponse()
        choices = [answers[i] for i in sorted(answers)]
        first = baton_pb2.GenerateResponse()
        first.CopyFrom(choices[0])
        if len(choices) > 1:  # sequence i ran as "<id>-<i>": the request's own id on top
            first.choices.extend(choices)
            first.request_id = request.request_id or choices[0].request_id.rsplit("-", 1)[0]
        return first

    async def GenerateStream(self, request, grpc_context: RayServegRPCContext):
        sent, started = False, set()
        async for index, chunk, stream in self._grpc_chunks(request, grpc_context):
            msg = baton_pb2.GenerateResponse(request_id=request.request_id or stream.request_id,
                                             token_ids=chunk.token_ids, text=chunk.text,
                                             logprobs=chunk.logprobs or [],
                                             top_logprobs=_grpc_top(chunk),
                                             produced_at=chunk.produced_at, index=index)
            if index not in started:
                started.add(index)
                _grpc_prompt(msg, stream)
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
