"""Each replica's metrics through Ray's export: two ingress, two decode and one prefill replica,
each with its own series (replica tags); counters only rise and add up to what was sent; each
decode replica's KV gauges are its own pool's; the prefill replica's engine moves too."""

import time
import urllib.request

import pytest
import requests

from deploy.ray_env import free_port
from tests.conftest import shutdown_serve

pytestmark = pytest.mark.e2e
NUM_BLOCKS = 128
PROMPTS = ["The quick brown fox", "Hello world", "a b c d e f", "one two three", "x", "yes"]


@pytest.fixture(scope="module")
def app(ray_cluster):
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"mode": "disaggregated",
                         "engine": {"model": "tiny", "num_blocks": NUM_BLOCKS, "max_num_seqs": 8},
                         "router": {"num_replicas": 2, "num_cpus": 0.1},
                         "decode": {"num_replicas": 2, "num_cpus": 0.25},
                         "prefill": {"num_replicas": 1, "num_cpus": 0.25}}),
              name="baton", route_prefix="/")
    yield f"http://127.0.0.1:{port}", ray_cluster._private.worker._global_node.metrics_export_port
    shutdown_serve()


def _scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    series: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_baton_"):
                series.setdefault(s.name, []).append((s.labels, s.value))
    return series


def _total(series, name, **match) -> float:
    return sum(v for labels, v in series.get(name, ())
               if all(labels.get(k) == want for k, want in match.items()))


def _by_replica(series, name, deployment) -> dict[str, float]:
    return {labels["replica"]: v for labels, v in series.get(name, ())
            if labels.get("deployment") == deployment}


def test_every_replica_reports_its_own_series(app):
    url, port = app
    sent = 0
    for i in range(3):  # several rounds, so both ingress and both decode replicas get some
        for prompt in PROMPTS:
            resp = requests.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": f"{prompt} {i}", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            sent += 1
    deadline, series = time.time() + 45, {}
    while time.time() < deadline:
        series = _scrape(port)
        done = _total(series, "ray_baton_request_success_total", deployment="DecodeServer")
        if done == sent and _total(series, "ray_baton_requests_total") == sent:
            break
        time.sleep(1)
    assert _total(series, "ray_baton_request_success_total", deployment="DecodeServer",
                  finish_reason="length") == sent
    assert _total(series, "ray_baton_request_success_total",
                  deployment="PrefillServer") == sent  # the prefill engine stops after one token
    assert _total(series, "ray_baton_requests_total", outcome="length") == sent  # the ingress
    assert _total(series, "ray_baton_generation_tokens_total",
                  deployment="DecodeServer") == sent * 5  # the first of 6 comes from prefill
    assert _total(series, "ray_baton_generation_tokens_total", deployment="PrefillServer") == sent
    assert _total(series, "ray_baton_kv_transfer_bytes_total", side="received") == \
        _total(series, "ray_baton_kv_transfer_bytes_total", side="sent") > 0
    # Each decode replica reports its own pool: distinct replica tags, used + free = all blocks.
    used = _by_replica(series, "ray_baton_kv_blocks_used", "DecodeServer")
    free = _by_replica(series, "ray_baton_kv_blocks_free", "DecodeServer")
    assert len(used) == 2 and set(used) == set(free)
    assert all(used[r] + free[r] == NUM_BLOCKS - 1 for r in used)
    steps = _by_replica(series, "ray_baton_engine_steps_total", "DecodeServer")
    assert len(steps) == 2 and all(v > 0 for v in steps.values())
    routers = {labels["replica"] for labels, _ in series["ray_baton_requests_total"]}
    assert len(routers) == 2
    assert _total(series, "ray_baton_engine_step_seconds_count", deployment="PrefillServer") > 0
    # Counters only rise.
    again = _scrape(port)
    for name in ("ray_baton_request_success_total", "ray_baton_generation_tokens_total",
                 "ray_baton_prompt_tokens_total", "ray_baton_requests_total"):
        before = {tuple(sorted(labels.items())): v for labels, v in series[name]}
        after = {tuple(sorted(labels.items())): v for labels, v in again[name]}
        assert all(after[k] >= v for k, v in before.items()), name
