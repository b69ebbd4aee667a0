"""An API key on the ingress: HTTP ``/v1/`` and gRPC calls without ``Bearer <key>`` are refused
(401 in OpenAI's error format, ``UNAUTHENTICATED``), with it they are served; ``/health`` and
``/metrics`` stay open."""

import pytest
import requests

from tests.conftest import shutdown_serve
from deploy.ray_env import free_port
from tests.test_serving_e2e import GRPC_SERVICER

pytestmark = pytest.mark.e2e
KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(ray_cluster):
    from ray import serve

    from deploy.app import build_app

    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app({"mode": "colocated", "engine": {"model": "tiny", "num_blocks": 64},
                         "router": {"api_key": KEY, "request_timeout_s": 60}}),
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
