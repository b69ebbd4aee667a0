"""Readiness and liveness on local Ray: while no decode replica can run (here: it asks for a
resource no node has), the ingress is alive (``/livez`` 200) but not ready (``/health`` 503, gRPC
``Health`` UNAVAILABLE), so a wait loop on ``/health`` waits for an app that can serve."""

import time

import grpc
import pytest
import requests

from deploy.ray_env import free_port
from tests.conftest import shutdown_serve
from tests.test_serving_e2e import GRPC_SERVICER

pytestmark = pytest.mark.e2e


def test_health_waits_for_a_decode_replica_livez_does_not(ray_cluster):
    from ray import serve

    from deploy.app import build_app
    from proto import baton_pb2, baton_pb2_grpc

    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    app = build_app({"mode": "colocated", "engine": {"model": "tiny", "num_blocks": 64},
                     "decode": {"resources": {"no_such_node_resource": 1}}})
    serve._run(app, _blocking=False, name="baton", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # the ingress replica comes up; the decode one never
            try:
                if requests.get(f"{url}/livez", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        assert requests.get(f"{url}/livez", timeout=10).json() == {"status": "ok"}
        health = requests.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                baton_pb2_grpc.BatonStub(channel).Health(baton_pb2.HealthRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        shutdown_serve()
