"""What a client is told when its request fails, and what the server log keeps.

A client gets a status (HTTP and gRPC), an OpenAI error type and one short sentence; never a
traceback, a process id, an actor id or a node address. The log gets one line for a client's
own error (bad input, a refused or timed-out request), and the whole traceback, under the
request's id, for a fault of the server; the client's message then names that id.

Errors raised inside another replica reach the ingress wrapped by Ray (``RayTaskError``, whose
text is the remote traceback); :func:`root_cause` unwraps them first.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

from contracts.token_channel import TokenChannelLost
from engine.errors import BadRequest, EngineDeadError

log = logging.getLogger("ray.serve.baton.errors")
MAX_MESSAGE_CHARS = 400


class RequestTimeout(Exception):
    """The request was not served before its deadline (``router.request_timeout_s``)."""


class NotStarted(Exception):
    """No first token within ``router.first_token_timeout_s``: every decode replica is busy
    with earlier work. Answered 429 with Retry-After (the request was aborted, nothing held)."""


NOT_STARTED_RETRY_S = 5


class AtCapacity(Exception):
    """No decode replica took the request within ``router.queue_timeout_s``: every live one
    holds all it may (``max_ongoing_requests``). Answered 429 with Retry-After at once (its
    Serve call was cancelled before it reached a replica)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownModel(Exception):
    """The request names a model this app does not serve (OpenAI and vLLM answer 404)."""


@dataclass
class Failure:
    status: int  # HTTP
    code: grpc.StatusCode
    kind: str  # OpenAI's error "type"
    message: str
    retry_after: int | None = None
    internal: bool = False  # a fault of the server: its traceback goes to the log

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


def root_cause(exc: BaseException) -> BaseException:
    """The exception raised where the error happened, out of Ray's wrappers."""
    from ray.exceptions import RayTaskError

    seen = set()
    while isinstance(exc, RayTaskError) and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def replica_lost(exc: BaseException) -> bool:
    """The decode replica that ran a request is gone (or its channel or engine is): the request
    can go on elsewhere. Any other error is the request's own."""
    from ray.exceptions import RayActorError

    return isinstance(exc, (RayActorError, TokenChannelLost, EngineDeadError))


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors of a request as one line: ``field: what is wrong; ...``."""
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc and loc not in msg else msg)
    return "; ".join(parts)


def _short(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= MAX_MESSAGE_CHARS else line[:MAX_MESSAGE_CHARS - 3] + "..."


def describe(exc: BaseException, request_id: str) -> Failure:
    """The answer to a request that failed with ``exc``."""
    from ray.serve.exceptions import BackPressureError

    cause = root_cause(exc)
    if isinstance(cause, (BackPressureError, AtCapacity)):  # full: come back shortly
        retry = math.ceil(cause.retry_after_s or 1)
        return Failure(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded_error",
                       f"the server is at capacity; retry after {retry} s", retry_after=retry)
    if isinstance(cause, NotStarted):
        return Failure(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded_error",
                       "the server is busy: the request could not start within the server's "
                       f"queue-time bound; retry after {NOT_STARTED_RETRY_S} s",
                       retry_after=NOT_STARTED_RETRY_S)
    if isinstance(cause, UnknownModel):
        return Failure(404, grpc.StatusCode.NOT_FOUND, "not_found_error", _short(str(cause)))
    if isinstance(cause, RequestTimeout):
        return Failure(504, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout", _short(str(cause)))
    if isinstance(cause, ValidationError):  # a request model refused its input
        return Failure(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error",
                       _short(validation_message(cause.errors())))
    if isinstance(cause, BadRequest):  # the request's own fault, whoever found it
        return Failure(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error",
                       _short(str(cause)))
    if replica_lost(cause):
        return Failure(503, grpc.StatusCode.UNAVAILABLE, "server_error",
                       f"request {request_id}: the replica serving it was lost and it could "
                       "not be moved in time; retry", internal=True)
    return Failure(500, grpc.StatusCode.INTERNAL, "server_error",
                   f"request {request_id} failed inside the server ({type(cause).__name__}); "
                   "the server log has the details under this id", internal=True)


def log_failure(failure: Failure, exc: BaseException, request_id: str) -> None:
    """One line for a client's error; the traceback for a fault of the server."""
    if failure.internal:
        log.error("request %s: %d %s", request_id, failure.status, failure.message,
                  exc_info=(type(exc), exc, exc.__traceback__))
    else:
        log.info("request %s: %d %s: %s", request_id, failure.status, failure.kind,
                 failure.message)
