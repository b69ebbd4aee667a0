"""The ingress's door on local Ray: an API key (HTTP ``/v1/`` and gRPC calls without
``Bearer <key>`` are refused, 401 in OpenAI's error format / ``UNAUTHENTICATED``; ``/health`` and
``/metrics`` stay open), a bound on request bodies (413), text prompts that cannot fit the
context refused fast, and errors raised in the decode replica reaching clients as a short
message (no traceback, no Ray internals) with one line in the ingress's log."""

import time
from pathlib import Path

import pytest
import requests

from tests.conftest import serve_log_dir, shutdown_serve
from deploy.ray_env import free_port
from tests.test_serving_e2e import GRPC_SERVICER

pytestmark = pytest.mark.e2e
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 64 * 1024
DECODE_BLOCKS = 16  # x 16 tokens: a 300-token prompt fits the context (2048), not the cache
OLD_LOGS: set[Path] = set()  # replica logs of other modules' apps
LEAKS = ("Traceback", "pid=", "ip=", "ray::", "\x1b[", "ActorID", "File \"")


@pytest.fixture(scope="module")
def server(ray_cluster):
    from ray import serve

    from deploy.app import build_app

    port, grpc_port = free_port(), free_port()
    OLD_LOGS.update(serve_log_dir().glob("replica_baton_*.log"))
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app({"mode": "colocated",
                         "engine": {"model": "tiny", "num_blocks": DECODE_BLOCKS},
                         "router": {"api_key": KEY, "request_timeout_s": 60,
                                    "max_request_bytes": MAX_BYTES}}),
              name="baton", route_prefix="/")
    yield f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    shutdown_serve()


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {KEY}", "Bearer"])
def test_http_without_the_key_is_401(server, header):
    url, _ = server
    headers = {"Authorization": header} if header else {}
    for path in ("/v1/models", "/v1/completions"):
        r = requests.post(f"{url}{path}", json={"prompt": "hi", "max_tokens": 2},
                          headers=headers, timeout=30) if path.endswith("completions") else \
            requests.get(f"{url}{path}", headers=headers, timeout=30)
        assert r.status_code == 401
        assert "API key" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "authentication_error"


def test_http_with_the_key_is_served_and_health_stays_open(server):
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    with requests.post(f"{url}/v1/completions", headers=auth, stream=True, timeout=60,
                       json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and b"[DONE]" in r.content
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert requests.get(f"{url}/metrics", timeout=10).status_code == 200


def test_grpc_needs_the_key(server):
    import grpc

    from proto import baton_pb2, baton_pb2_grpc
    _, address = server
    with grpc.insecure_channel(address) as channel:
        stub = baton_pb2_grpc.BatonStub(channel)
        req = baton_pb2.GenerateRequest(prompt="hi", max_tokens=2)
        for metadata in (None, [("authorization", "Bearer nope")]):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(req, metadata=metadata, timeout=30)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in err.value.details()
        ok = [("authorization", f"Bearer {KEY}")]
        assert len(stub.Generate(req, metadata=ok, timeout=60).token_ids) == 2
        assert len(list(stub.GenerateStream(req, metadata=ok, timeout=60))) >= 1
        assert stub.Health(baton_pb2.HealthRequest(), timeout=10).status == "ok"


def test_grpc_bytes_that_do_not_parse_and_oversized_messages_are_refused(server):
    """Invalid UTF-8 in a string field: INVALID_ARGUMENT with the parser's reason (not UNKNOWN);
    a message over 4 MiB: RESOURCE_EXHAUSTED at once, from its length, before it is read."""
    import grpc

    from proto import baton_pb2
    _, address = server
    ok = [("authorization", f"Bearer {KEY}")]
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length",
                                                  64 << 20)]) as channel:
        raw = channel.unary_unary("/baton.v1.Baton/Generate")  # bytes in, bytes out
        good = baton_pb2.GenerateRequest(prompt="h\u00e9llo", max_tokens=2).SerializeToString()
        assert baton_pb2.GenerateResponse.FromString(raw(good, metadata=ok, timeout=60)).token_ids
        with pytest.raises(grpc.RpcError) as err:
            raw(good.replace("\u00e9".encode(), b"\xff\xfe"), metadata=ok, timeout=30)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "UTF-8" in err.value.details()
        big = baton_pb2.GenerateRequest(prompt="a" * (5 << 20)).SerializeToString()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            raw(big, metadata=ok, timeout=30)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 5


def _answers(url) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {(s.labels["protocol"], s.labels["code"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "baton_responses_total"}


def test_answers_are_counted_by_protocol_and_status_code(server):
    """One ingress replica here, so its own /metrics holds every answer (401s at the door
    included)."""
    import grpc

    from proto import baton_pb2, baton_pb2_grpc
    url, address = server
    before = _answers(url)
    assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert requests.get(f"{url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert _completion(url, {"prompt": "hi", "max_tokens": 0}).status_code == 400
    with grpc.insecure_channel(address) as channel:
        stub = baton_pb2_grpc.BatonStub(channel)
        req = baton_pb2.GenerateRequest(prompt="hi", max_tokens=2)
        with pytest.raises(grpc.RpcError):
            stub.Generate(req, timeout=30)
        stub.Generate(req, metadata=[("authorization", f"Bearer {KEY}")], timeout=60)
    after = _answers(url)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {("http", "401"): 1, ("http", "200"): 2, ("http", "400"): 1,
                    ("grpc", "UNAUTHENTICATED"): 1, ("grpc", "OK"): 1}  # 200s: /v1/models, the first scrape


def _completion(url, body, **kw):
    return requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60, **kw)


def test_a_body_over_the_bound_is_refused_before_it_is_parsed(server):
    url, _ = server
    big = b'{"prompt": "' + b"a " * MAX_BYTES + b'"}'
    r = requests.post(f"{url}/v1/completions", data=big, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and f"{MAX_BYTES} bytes" in r.json()["error"]["message"]
    chunked = requests.post(f"{url}/v1/completions", timeout=60,  # no Content-Length
                            data=(big[i:i + 8192] for i in range(0, len(big), 8192)),
                            headers={**AUTH, "Content-Type": "application/json"})
    assert chunked.status_code == 413
    huge = b'{"messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}'
    for _ in range(5):  # 20 MB: the 413 every time, never a reset while the client still sends
        r = requests.post(f"{url}/v1/chat/completions", data=huge, timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413
    assert _completion(url, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_text_prompt_that_cannot_fit_is_a_400(server):
    url, _ = server
    words = "the quick brown fox jumps over the lazy dog "
    for text in (words * 1300, words * 400):  # 57 kB: refused by its length; 18 kB: counted
        r = _completion(url, {"prompt": text, "max_tokens": 2})
        assert r.status_code == 400
        assert "context of 2048 tokens" in r.json()["error"]["message"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_an_error_raised_in_the_decode_replica_reaches_the_client_clean(server):
    """The decode engine refuses a prompt its KV cache cannot hold: the client gets the
    engine's sentence over HTTP (whole or streamed) and gRPC, nothing of Ray's wrapping."""
    import grpc

    from proto import baton_pb2, baton_pb2_grpc
    url, address = server
    body = {"prompt": [7] * 300, "max_tokens": 2}
    for stream in (False, True):
        r = _completion(url, {**body, "stream": stream})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "KV blocks" in message and not any(leak in message for leak in LEAKS)
    with grpc.insecure_channel(address) as channel:
        stub = baton_pb2_grpc.BatonStub(channel)
        req = baton_pb2.GenerateRequest(prompt_token_ids=[7] * 300, max_tokens=2)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, metadata=[("authorization", f"Bearer {KEY}")], timeout=60)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "KV blocks" in err.value.details()
        assert not any(leak in err.value.details() for leak in LEAKS)


def test_client_errors_leave_one_line_in_the_log_and_no_traceback(server):
    import grpc

    from proto import baton_pb2, baton_pb2_grpc
    url, address = server
    marker = 4.25  # a temperature no other test sends
    assert _completion(url, {"prompt": "hi", "temperature": -marker}).status_code == 400
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError):
            baton_pb2_grpc.BatonStub(channel).Generate(
                baton_pb2.GenerateRequest(prompt="hi", temperature=-marker),
                metadata=[("authorization", f"Bearer {KEY}")], timeout=30)
    # Two clients that leave mid-stream: HTTP and gRPC.
    with requests.post(f"{url}/v1/completions", headers=AUTH, stream=True, timeout=60,
                       json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                             "stream": True}) as r:
        next(r.iter_lines())
    with grpc.insecure_channel(address) as channel:
        call = baton_pb2_grpc.BatonStub(channel).GenerateStream(
            baton_pb2.GenerateRequest(prompt="hi", max_tokens=200, ignore_eos=True),
            metadata=[("authorization", f"Bearer {KEY}")], timeout=60)
        next(call)
        call.cancel()
    deadline, lines, cancels = time.time() + 20, [], []
    while (len(lines) < 2 or len(cancels) < 2) and time.time() < deadline:
        time.sleep(0.3)
        text = "".join(f.read_text(errors="replace")
                       for f in set(serve_log_dir().glob("replica_baton_*.log")) - OLD_LOGS)
        lines = [line for line in text.splitlines() if f"got -{marker}" in line]
        cancels = [line for line in text.splitlines() if "ingress: cancelled" in line]
    assert len(lines) == 2, lines
    assert len(cancels) == 2, cancels
    # No traceback of ours. Two that come from Serve and grpcio when a gRPC client cancels a
    # stream are allowed: grpcio's failed ExecuteBatch (the direct
    # ingress sends the status of a call already cancelled), or Serve's "unexpected error"
    # when grpcio closes the response generator while it waits at a yield (GeneratorExit).
    known = (text.count("cygrpc.ExecuteBatchError: Failed")
             + text.count("in _direct_ingress_grpc_streaming_response\\n    yield message"))
    at = text.find("Traceback (most recent call last)")
    assert text.count("Traceback (most recent call last)") == known, text[at:at + 4000]
