"""The ingress's door, without Ray: the body bound (413 before parsing), the API key, prompts
tokenized off the event loop with work bounded by the context, and what clients are told when
a request fails (no traceback, no Ray internals) against what the log keeps."""

import asyncio
import json
import logging
import threading
from importlib import resources

import pytest

from engine.errors import BadRequest
from engine.model_source import load_tokenizer, resolve_model
from router.ingress.door import APIKeyMiddleware, BodyLimitMiddleware, OpenRequestsMiddleware
from router.ingress.errors import RequestTimeout, describe, log_failure
from router.ingress.prompts import INLINE_CHARS, SLICE_CHARS, PromptEncoder


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny"))


@pytest.fixture(scope="module")
def corpus():
    return (resources.files("engine") / "tiny_corpus.txt").read_text()


class SpyTokenizer:
    """The real tokenizer, recording how many characters it was given and on which thread."""

    def __init__(self, tokenizer):
        self.inner, self.chars, self.threads = tokenizer, 0, set()

    def encode(self, text, add_special_tokens=False):
        self.chars += len(text)
        self.threads.add(threading.current_thread().name)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# -- prompts ----------------------------------------------------------------------------------
def test_long_text_is_tokenized_off_the_loop_and_equals_one_encode(tokenizer, corpus):
    text = (corpus * (3 * SLICE_CHARS // len(corpus) + 1))[:3 * SLICE_CHARS]
    spy = SpyTokenizer(tokenizer)
    enc = PromptEncoder(spy, max_model_len=10**6)
    ids = asyncio.run(enc.encode(text))
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert spy.threads and all(t.startswith("tokenize") for t in spy.threads)
    enc.close()


def test_slices_cut_where_the_tokenizer_cuts(tokenizer, corpus):
    """Cut before a word-starting space, the slices' counts add up to the whole text's."""
    text = (corpus * (4 * SLICE_CHARS // len(corpus) + 1))[:4 * SLICE_CHARS]
    start, total = 0, 0
    while start < len(text):
        end = PromptEncoder._cut(text, start)
        assert end == len(text) or text[end] == " "
        total += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        start = end
    assert total == len(tokenizer.encode(text, add_special_tokens=False))


def test_short_text_is_tokenized_inline(tokenizer):
    spy = SpyTokenizer(tokenizer)
    enc = PromptEncoder(spy, max_model_len=2048)
    asyncio.run(enc.encode("hello " * (INLINE_CHARS // 6)))
    assert spy.threads == {threading.current_thread().name}
    enc.close()


def test_a_text_far_over_the_context_costs_a_context_of_work(tokenizer, corpus):
    text = (corpus * (3_000_000 // len(corpus) + 1))[:3_000_000]
    spy = SpyTokenizer(tokenizer)
    enc = PromptEncoder(spy, max_model_len=2048)
    enc.max_token_bytes = 10**4  # so the length alone proves nothing
    with pytest.raises(ValueError, match="longer than the model's context of 2048 tokens"):
        asyncio.run(enc.encode(text))
    assert spy.chars <= 2 * SLICE_CHARS  # tokens of ~32k chars pass 2048; never the 3 MB
    enc.close()


def test_a_text_its_length_rules_out_is_never_tokenized(tokenizer):
    spy = SpyTokenizer(tokenizer)
    enc = PromptEncoder(spy, max_model_len=2048)
    with pytest.raises(ValueError, match="more than the model's context of 2048 tokens"):
        asyncio.run(enc.encode("x" * (2048 * enc.max_token_bytes + 1)))
    assert spy.chars == 0
    enc.close()


@pytest.mark.parametrize("size", [100, 3 * INLINE_CHARS])
def test_chat_ids_equal_the_templates_own_tokenizing(tokenizer, corpus, size):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": corpus[:size]}]
    enc = PromptEncoder(tokenizer, max_model_len=10**6)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert asyncio.run(enc.render_chat(messages)) == list(want)
    enc.close()


@pytest.mark.parametrize("kwargs", [
    {"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                      "{% endfor %}"},  # the client's own template: unbounded work on the loop
    {"tokenize": True}, {"tools": []}, {"add_generation_prompt": False}, {"messages": 1},
    {"self": 1}])
def test_chat_template_kwargs_name_template_variables_only(tokenizer, kwargs):
    """A request's ``chat_template_kwargs`` are the template's variables: one naming the
    renderer's own arguments (a template of its own among them) is a 400 naming it, before
    anything is rendered, never a TypeError's 500; a template variable still goes through."""
    enc = PromptEncoder(tokenizer, max_model_len=10**6)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match=f"chat_template_kwargs: '{next(iter(kwargs))}'"):
        asyncio.run(enc.render_chat(hi, template_kwargs=kwargs))
    want = tokenizer.apply_chat_template(hi, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
    got = asyncio.run(enc.render_chat(hi, template_kwargs={"enable_thinking": False}))
    assert got == tokenizer.encode(want, add_special_tokens=False)
    enc.close()


# -- the door ---------------------------------------------------------------------------------
def _call(middleware, method="POST", headers=(), chunks=(b"{}",), path="/v1/completions"):
    """Run one request through ``middleware`` around an app that reads the whole body and
    answers 200 with its length; returns (status, response body, body the app saw)."""
    seen, sent = [], []

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    asyncio.run(middleware(app)(scope, receive, send))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, body, seen[0] if seen else None


@pytest.fixture
def limit(monkeypatch):
    monkeypatch.setattr(BodyLimitMiddleware, "max_bytes", 1000)


def test_a_declared_large_body_is_refused_unread(limit):
    status, body, seen = _call(BodyLimitMiddleware, headers=[("Content-Length", "5000")],
                               chunks=(b"x" * 5000,))
    assert status == 413 and seen is None
    assert "1000 bytes" in json.loads(body)["error"]["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_bound(limit):
    status, _, seen = _call(BodyLimitMiddleware, chunks=[b"x" * 400] * 5)
    assert status == 413 and seen is None


def test_a_chunked_body_within_the_bound_reaches_the_app_whole(limit):
    """Read here to count it, then given to the app as one message."""
    status, _, seen = _call(BodyLimitMiddleware, chunks=[b"x" * 300, b"y" * 300, b"z" * 300])
    assert status == 200 and seen == b"x" * 300 + b"y" * 300 + b"z" * 300


@pytest.mark.parametrize("headers", [[("Content-Length", "8000")], []])
def test_a_refused_body_is_read_to_its_end_before_the_connection_closes(limit, headers):
    """So that a client still sending gets the 413 and not a reset (the kernel resets a
    connection closed with unread data)."""
    chunks = [b"x" * 400] * 20
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app saw a refused body")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    asyncio.run(BodyLimitMiddleware(app)(scope, receive, send))
    assert sent[0]["status"] == 413 and messages == []


def test_bodies_within_the_bound_reach_the_app_whole(limit):
    assert _call(BodyLimitMiddleware, chunks=[b"a" * 300, b"b" * 300])[::2] == \
        (200, b"a" * 300 + b"b" * 300)
    assert _call(BodyLimitMiddleware, headers=[("Content-Length", "800")],
                 chunks=(b"c" * 800,))[::2] == (200, b"c" * 800)
    assert _call(BodyLimitMiddleware, method="GET", chunks=(b"",))[0] == 200


def test_the_api_key_is_checked_everywhere_but_the_probes(monkeypatch):
    monkeypatch.setattr(APIKeyMiddleware, "key", "sekret")
    assert _call(APIKeyMiddleware)[0] == 401
    assert _call(APIKeyMiddleware, headers=[("Authorization", "Bearer wrong")])[0] == 401
    assert _call(APIKeyMiddleware, headers=[("Authorization", "Bearer sekret")])[0] == 200
    assert _call(APIKeyMiddleware, path="/tokenize")[0] == 401
    assert _call(APIKeyMiddleware, method="GET", path="/openapi.json")[0] == 401
    for probe in ("/health", "/livez", "/metrics"):
        assert _call(APIKeyMiddleware, method="GET", path=probe)[0] == 200


def test_beyond_the_open_bound_a_generation_request_is_refused_at_the_door(monkeypatch):
    """With two generation requests open (held in the app) and a bound of two, a third gets a
    429 with Retry-After at once, its body read but never parsed; other paths pass; once one
    ends, a request goes in again; the count comes back to zero whatever the app did."""
    monkeypatch.setattr(OpenRequestsMiddleware, "limit", lambda: 2)
    monkeypatch.setattr(OpenRequestsMiddleware, "retry_after_s", 1.5)
    monkeypatch.setattr(OpenRequestsMiddleware, "open", 0)
    release, reached = asyncio.Event(), []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        if scope["path"] == "/v1/completions":
            await release.wait()
        if scope["path"] == "/boom":
            raise RuntimeError("the app failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def one(path):
        sent, body = [], [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            return body.pop(0) if body else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        try:
            await OpenRequestsMiddleware(app)(scope, receive, send)
        except RuntimeError:
            return 500, {}
        return sent[0]["status"], dict(sent[0]["headers"])

    async def main():
        held = [asyncio.ensure_future(one("/v1/completions")) for _ in range(2)]
        await asyncio.sleep(0.01)
        status, headers = await asyncio.wait_for(one("/v1/chat/completions"), 1)
        assert (status, headers[b"retry-after"]) == (429, b"2")
        assert reached == ["/v1/completions"] * 2  # the refused one never reached the app
        assert (await one("/tokenize"))[0] == 200  # not a generation path
        release.set()
        assert [s for s, _ in await asyncio.gather(*held)] == [200, 200]
        assert (await one("/v1/chat/completions"))[0] == 200

    asyncio.run(main())
    assert OpenRequestsMiddleware.open == 0
    monkeypatch.setattr(OpenRequestsMiddleware, "limit", lambda: None)  # no bound known
    assert _call(OpenRequestsMiddleware)[0] == 200


def test_the_door_bound_is_this_replicas_share_of_the_decode_pool():
    """The app's bound (HAProxy's, router.ingress.haproxy) is what the live decode replicas
    hold; the door's is this ingress replica's share of it."""
    from types import SimpleNamespace

    from router.ingress.service import RequestService, per_decode_replica
    svc = SimpleNamespace(_decode_replicas=SimpleNamespace(value=3), _per_decode_replica=320,
                          _ingress_replicas=2)
    svc.pool_bound = lambda: RequestService.pool_bound(svc)
    assert RequestService.pool_bound(svc) == 960
    assert RequestService.open_limit(svc) == 480
    svc._decode_replicas.value = 0  # none listed (starting, or all gone): no bound
    assert RequestService.open_limit(svc) is None and RequestService.pool_bound(svc) is None
    svc._decode_replicas = None  # early refusal off
    assert RequestService.open_limit(svc) is None and RequestService.pool_bound(svc) is None
    # a decode queue of -1 is Serve's unbounded one: the app sets no bound either
    assert per_decode_replica(256, 64) == 320 and per_decode_replica(256, None) == 256
    assert per_decode_replica(256, -1) is None
    svc._decode_replicas, svc._per_decode_replica = SimpleNamespace(value=3), None
    assert RequestService.pool_bound(svc) is None and RequestService.open_limit(svc) is None


# -- what a failure says ----------------------------------------------------------------------
def _remote(exc: BaseException) -> BaseException:
    """``exc`` as the ingress receives it from another replica: wrapped by Ray, whose text is
    the remote traceback with the process, node and actor."""
    from ray.exceptions import RayTaskError

    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001
        import traceback
        tb = "".join(traceback.format_exception(raised))
    return RayTaskError("DecodeServer.generate", tb, exc, proctitle="ray::ServeReplica:baton",
                        pid=4242, ip="10.1.2.3", actor_id="ab" * 16).as_instanceof_cause()


LEAKS = ("Traceback", "4242", "10.1.2.3", "abab", "ray::", "\x1b[")


def test_an_error_raised_in_another_replica_reaches_the_client_clean():
    from engine.errors import BadRequest
    exc = _remote(BadRequest("prompt: 300 tokens need 19 KV blocks; the cache has 16"))
    assert "pid=4242" in str(exc)  # what clients were sent before
    failure = describe(exc, "cmpl-1")
    assert (failure.status, failure.kind) == (400, "invalid_request_error")
    assert failure.message == "prompt: 300 tokens need 19 KV blocks; the cache has 16"


def test_a_server_fault_names_the_request_not_its_internals():
    failure = describe(_remote(RuntimeError("CUDA error at 0xdeadbeef")), "cmpl-7")
    assert failure.status == 500 and failure.internal
    assert "cmpl-7" in failure.message and "RuntimeError" in failure.message
    assert not any(leak in failure.message for leak in LEAKS + ("deadbeef",))


def test_statuses_of_the_other_failures():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    import grpc
    overload = describe(BackPressureError(num_queued_requests=9, max_queued_requests=8,
                                          retry_after_s=2.5), "r")
    assert (overload.status, overload.code, overload.retry_after) == \
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED, 3)
    assert describe(RequestTimeout("not served in time"), "r").status == 504
    lost = describe(ActorDiedError(), "r")
    assert (lost.status, lost.code) == (503, grpc.StatusCode.UNAVAILABLE)
    assert not any(leak in lost.message for leak in LEAKS)


def test_client_errors_log_one_line_server_faults_their_traceback(caplog):
    caplog.set_level(logging.INFO, logger="ray.serve.baton.errors")
    from engine.errors import BadRequest
    bad = _remote(BadRequest("top_p must be in (0, 1]"))
    log_failure(describe(bad, "a"), bad, "a")
    fault = _remote(RuntimeError("boom"))
    log_failure(describe(fault, "b"), fault, "b")
    first, second = caplog.records
    assert first.exc_info is None and "\n" not in first.getMessage()
    assert second.exc_info is not None and "request b" in second.getMessage()


def test_the_decode_pool_count_is_kept_off_the_door_and_refreshed_in_the_background(
        monkeypatch):
    """contracts.role.ReplicaCount: the door reads the last count at once (None before the
    first), a recount runs in the background once it is ``refresh_s`` old, and a registry that
    fails keeps the last count."""
    import contracts.role as role

    listed = [{"name": "SERVE_REPLICA::x#a"}, {"name": "SERVE_REPLICA::x#b"}]
    monkeypatch.setattr(role, "replica_actor_prefix", lambda handle: "SERVE_REPLICA::x#")
    monkeypatch.setattr(role, "replica_names", lambda prefix: list(listed))

    async def main():
        count = role.ReplicaCount(object(), refresh_s=0.05)
        assert count.value is None  # the first count starts now, in the background
        await asyncio.sleep(0.02)
        assert count.value == 2
        listed.append({"name": "SERVE_REPLICA::x#c"})
        assert count.value == 2  # not yet stale
        await asyncio.sleep(0.06)
        count.value  # stale: a recount starts
        await asyncio.sleep(0.02)
        assert count.value == 3

        def broken(prefix):
            raise RuntimeError("the registry did not answer")
        monkeypatch.setattr(role, "replica_names", broken)
        await asyncio.sleep(0.06)
        count.value
        await asyncio.sleep(0.02)
        assert count.value == 3

    asyncio.run(main())
