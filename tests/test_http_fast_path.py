"""The generation endpoints' fast path (``router.ingress.http.GenerationFastPath``), without
Ray: a body that parses and validates goes straight to the adapter, and every answer, the
refusals of bad bodies included, is the one FastAPI gives for the same request."""

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.ingress import http
from router.ingress.protocol import ChatCompletionRequest, CompletionRequest


class StubAdapter:
    """Answers from the parsed body itself: equal answers mean equal parsed requests."""

    def __init__(self):
        self.calls = 0

    async def completions(self, body: CompletionRequest):
        return self._answer(body)

    async def chat(self, body: ChatCompletionRequest):
        return self._answer(body)

    def _answer(self, body):
        self.calls += 1
        seen = body.model_dump(mode="json")
        if not body.stream:
            return {"seen": seen}

        async def events():
            yield http._event({"seen": seen})
            yield "data: [DONE]\n\n"
        return http.DeferredStreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def apps(monkeypatch):
    """FastAPI alone (the routes as the deployment declares them, the ingress's error
    handlers), the same behind the fast path, the adapter both call, and how often FastAPI's
    route ran."""
    adapter, routed = StubAdapter(), []
    ref = FastAPI()
    ref.add_exception_handler(StarletteHTTPException, http._http_error)
    ref.add_exception_handler(RequestValidationError, http._validation_error)

    @ref.post("/v1/completions")
    async def completions(body: CompletionRequest):
        routed.append(body)
        return await adapter.completions(body)

    @ref.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        routed.append(body)
        return await adapter.chat(body)

    monkeypatch.setattr(http.GenerationFastPath, "adapter", adapter)
    return ref, http.GenerationFastPath(ref), adapter, routed


def call(app, path: str, body: bytes, content_type: str | None = "application/json",
         method: str = "POST", root_path: str = "") -> tuple[int, str, bytes]:
    """One request through the ASGI app: (status, content type, body)."""
    headers = [(b"host", b"test")]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http",
             "path": root_path + path, "raw_path": (root_path + path).encode(),
             "query_string": b"", "root_path": root_path, "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    parts = [{"type": "http.request", "body": body[:5], "more_body": True},
              {"type": "http.request", "body": body[5:], "more_body": False}]
    sent = []

    async def receive():
        if parts:
            return parts.pop(0)
        await asyncio.sleep(30)  # the client stays until the answer is whole
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def run():
        await asyncio.wait_for(app(scope, receive, send), 10)
    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    kind = dict(start["headers"]).get(b"content-type", b"").decode()
    return start["status"], kind, b"".join(m.get("body", b"") for m in sent
                                            if m["type"] == "http.response.body")


GOOD = [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}),  # ignored, as vLLM does
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream": True}),
]


@pytest.mark.parametrize("path, body", GOOD)
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "application/vnd.api+json"])
def test_a_good_body_skips_fastapi_with_fastapi_s_answer(apps, path, body, content_type):
    ref, fast, adapter, routed = apps
    raw = json.dumps(body).encode()
    want = call(ref, path, raw, content_type)
    assert len(routed) == 1 and adapter.calls == 1
    got = call(fast, path, raw, content_type)
    assert len(routed) == 1 and adapter.calls == 2  # the adapter, not FastAPI's route
    assert got[0] == want[0] == 200 and got[1] == want[1]
    if body.get("stream"):
        assert got[2] == want[2] and got[2].startswith(b"data: ")
    else:
        assert json.loads(got[2]) == json.loads(want[2])


BAD = [
    (b'{"prompt": ', "application/json"),  # not JSON
    (b'{"prompt": "hi", "temperature": NaN}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": 1e100}', "application/json"),
    (b'{"prompt": 5}', "application/json"),
    (b'{"prompt": "hi", "suffix": "x"}', "application/json"),  # a validator's refusal
    (b'{"prompt": "caf\xe9"}', "application/json"),  # not UTF-8
    (b'[1, 2]', "application/json"),
    (b'', "application/json"),
    (b'{"prompt": "hi"}', "text/plain"),
    (b'{"prompt": "hi"}', None),  # no content type: FastAPI's rule decides
]


@pytest.mark.parametrize("raw, content_type", BAD)
def test_every_other_request_gets_fastapi_s_own_answer(apps, raw, content_type):
    ref, fast, adapter, routed = apps
    for path in ("/v1/completions", "/v1/chat/completions"):
        want = call(ref, path, raw, content_type)
        got = call(fast, path, raw, content_type)
        assert got == want and (want[0] == 200) == bool(routed)
    assert len(routed) == adapter.calls  # only ever through FastAPI's route


def test_other_methods_paths_and_a_root_path(apps):
    ref, fast, adapter, routed = apps
    assert call(fast, "/v1/completions", b"", method="GET") == \
        call(ref, "/v1/completions", b"", method="GET")  # 405, FastAPI's
    body = json.dumps({"prompt": "hi"}).encode()
    assert call(fast, "/v1/other", body)[0] == 404
    # under a route prefix, as Serve mounts an app below its root
    status, _, answer = call(fast, "/v1/completions", body, root_path="/baton")
    assert status == 200 and json.loads(answer)["seen"]["prompt"] == "hi" and not routed


def test_without_an_adapter_everything_is_fastapi_s(apps, monkeypatch):
    ref, fast, adapter, routed = apps
    monkeypatch.setattr(http.GenerationFastPath, "adapter", None)
    assert call(fast, "/v1/completions", json.dumps({"prompt": "hi"}).encode())[0] == 200
    assert len(routed) == 1 == adapter.calls


def _stream_request(events):
    """A streamed answer of ``events`` through the ingress's response class, as uvicorn calls it
    (ASGI spec 2.3): (a coroutine running it to its end, returning its task; what was sent)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    sent = []

    async def receive():
        await asyncio.sleep(30)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def run():
        response = http.DeferredStreamingResponse(events, media_type="text/event-stream")
        await response(scope, receive, send)
        return asyncio.current_task()
    return run, sent


def test_a_stream_runs_in_the_request_s_own_task_and_stops_with_it():
    """The body's first step runs in the task that called the response (no task group, no wait
    for a new task's turn); cancelling that task, as Serve does when the client leaves, stops
    the stream and closes its body."""
    seen, closed = [], []

    async def events(streaming: asyncio.Event):
        seen.append(asyncio.current_task())
        try:
            yield "data: 1\n\n"
            streaming.set()
            await asyncio.sleep(30)
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def main():
        streaming = asyncio.Event()
        run, sent = _stream_request(events(streaming))
        task = asyncio.ensure_future(run())
        await asyncio.wait_for(streaming.wait(), 10)
        assert seen == [task]
        task.cancel()  # the client left: Serve cancels the request's task
        with pytest.raises(asyncio.CancelledError):
            await task
        bodies = [m.get("body") for m in sent if m["type"] == "http.response.body"]
        assert closed == [True] and sent[0]["status"] == 200 and bodies == [b"data: 1\n\n"]
    asyncio.run(main())


def test_a_stream_cancelled_while_its_client_reads_slowly_closes_its_body_at_once():
    """Cancelled while it waits in ``send`` (a slow client), not inside the body: the body is
    closed then (its ``finally`` cancels the Serve call and frees what the request holds), not
    whenever the garbage collector gets to it."""
    closed = []

    async def events():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def main():
        body = events()  # (held here: the collector cannot be what closes it)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        sending = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                sending.set()
                await asyncio.sleep(30)  # the client reads slowly

        task = asyncio.ensure_future(http.DeferredStreamingResponse(
            body, media_type="text/event-stream")(scope, None, send))
        await asyncio.wait_for(sending.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == [True]
    asyncio.run(main())


def test_a_stream_s_error_is_raised_as_itself():
    async def events():
        yield "data: 1\n\n"
        raise KeyError("boom")

    async def main():
        run, _ = _stream_request(events())
        with pytest.raises(KeyError):
            await asyncio.wait_for(run(), 10)
    asyncio.run(main())
