"""What every HTTP request passes before the app reads it: the API key, then the body's size.

Both are plain ASGI middlewares (streamed responses pass through untouched) whose settings the
ingress replica fills in at start (``router.api_key`` / ``BATON_API_KEY``,
``router.max_request_bytes``).

- With an API key, every request must carry ``Authorization: Bearer <key>``; others get a
  401. ``/health``, ``/livez`` and ``/metrics`` stay open for probes.
- A body larger than ``max_request_bytes`` gets a 413 before anything parses it: when its
  ``Content-Length`` says so, or as soon as a chunked body passes the bound (what was read is
  dropped). The app so never holds more than one bound's worth of a request's body. The refused
  body is read to its end and dropped first (up to ``DRAIN_BYTES``, for ``DRAIN_S`` at most),
  then the 413 is sent: the server reads nothing of a request once its answer is complete, and
  closing over unread bytes makes the kernel reset the connection, which can take the 413 with
  it (measured: one 20 MB post in about 30 lost its 413 while the drain came after the answer).
  A body read to its end keeps the connection; one past the drain's bounds closes it.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import math
import time

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# When the HTTP request now handled reached the ingress's app (``time.time()``; 0.0 outside an
# HTTP request): set by the outermost middleware, read into the request's timing.
ARRIVED: contextvars.ContextVar[float] = contextvars.ContextVar("baton_http_arrived",
                                                               default=0.0)
OPEN_PATHS = frozenset({"/health", "/livez", "/metrics"})  # probes and scrapers: no API key asked
DRAIN_BYTES = 256 * 1024 * 1024  # a refused body read to its end up to this, to close cleanly
DRAIN_S = 10.0


async def send_error(send, status: int, message: str, kind: str,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    """An OpenAI-format error answer, straight over ASGI."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def authorized(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


class APIKeyMiddleware:
    key: str | None = None  # set by the ingress replica

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            if not authorized(headers.get(b"authorization", b"").decode("latin-1"), self.key):
                await send_error(send, 401, "invalid or missing API key: send the header "
                                 "'Authorization: Bearer <key>'", "authentication_error")
                return
        await self.app(scope, receive, send)


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class OpenRequestsMiddleware:
    """Refuses a generation request at once, before its body is parsed or its prompt tokenized,
    while this ingress replica already has its share of what the decode pool holds open: a
    client gets its 429 in the time the door takes, not after the ingress has worked through
    the burst ahead of it (on two CPU cores, 1,000 streams sent at once waited 3.5-6.4 s for
    their refusals). ``limit``: set by the ingress replica, a callable giving the current bound
    (None: none known, every request goes in)."""

    limit = None
    retry_after_s = 1.0
    open = 0  # this replica's generation requests between the door and their answer's end

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS or self.limit is None:
            await self.app(scope, receive, send)
            return
        cls = OpenRequestsMiddleware
        bound = cls.limit()
        if bound is not None and cls.open >= bound:
            await drain(receive, timeout_s=1.0)  # a body left unread can turn into a reset
            retry = str(math.ceil(cls.retry_after_s))
            await send_error(send, 429, f"the server is at capacity ({cls.open} requests open "
                             f"here); retry after {retry} s", "overloaded_error",
                             [(b"retry-after", retry.encode())])
            return
        cls.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            cls.open -= 1


class StatusCountMiddleware:
    """Counts HTTP answers by status code (outermost, so refusals at the door count too). A
    stream counts with the status it started with: an error after its first chunk is in-band.
    Being first, it also stamps when the request arrived (:data:`ARRIVED`)."""
    count = None  # set by the ingress replica: a callable taking the status code

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            ARRIVED.set(time.time())  # this request's own task: no other request sees it
        if scope["type"] != "http" or self.count is None:
            await self.app(scope, receive, send)
            return

        async def counted(message):
            if message["type"] == "http.response.start":
                self.count(message["status"])
            await send(message)

        await self.app(scope, receive, counted)


class BodyLimitMiddleware:
    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # set by the ingress replica

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def _too_large(self, receive, send, size: str, more_body: bool = True):
        # The body is read to its end first: once an answer is complete the server reads no
        # more of the request, and closing over unread bytes resets the connection, which can
        # take the 413 with it. A body too large or too slow to drain closes after the answer.
        drained = await drain(receive) if more_body else True
        await send_error(send, 413, f"request body {size} is larger than this server accepts "
                         f"({self.max_bytes} bytes; router.max_request_bytes)",
                         "invalid_request_error", [] if drained else [(b"connection", b"close")])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await send_error(send, 400, "Content-Length is not a number",
                                 "invalid_request_error")
                return
            if declared > self.max_bytes:
                await self._too_large(receive, send, f"of {declared} bytes")
                return
            await self.app(scope, receive, send)  # the server reads no more than declared
            return
        # Chunked: read it here, up to the bound, then hand the app what was read.
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(receive, send, "of more than that",
                                      message.get("more_body", False))
                return
            messages.append(message)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(b"".join(m.get("body", b"") for m in messages), receive),
                       send)


def replay(body: bytes, receive):
    """``receive`` with a body already read given back first, whole."""
    replayed = False

    async def replayed_receive():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed_receive


async def drain(receive, limit: int = DRAIN_BYTES, timeout_s: float = DRAIN_S) -> bool:
    """Read and drop the rest of a request's body (up to ``limit`` bytes, for ``timeout_s`` at
    most), before any answer is sent (the server stops reading a request once its answer is
    complete); whether its end was reached."""
    read = 0

    async def read_all() -> bool:
        nonlocal read
        while read <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return False
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    try:
        return await asyncio.wait_for(read_all(), timeout_s)
    except asyncio.TimeoutError:
        return False
