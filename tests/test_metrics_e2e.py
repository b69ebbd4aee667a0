"""Each replica's metrics through Ray's export: two ingress, two decode and one prefill replica,
each with its own series (replica tags); counters only rise and add up to what was sent; each
decode replica's KV gauges are its own pool's; the prefill replica's engine moves too."""

import re
import time
import urllib.request
from pathlib import Path

import pytest
import requests

from deploy.ray_env import free_port
from tests.conftest import shutdown_serve

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
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


def _delta(before, after, name, **match) -> float:
    """How much the matching series rose between two scrapes (the shared test cluster also
    exports the series of earlier tests' replicas, which stay where they were)."""
    return _total(after, name, **match) - _total(before, name, **match)


def _risen(before, after, name, deployment) -> set[str]:
    """Replicas of ``deployment`` whose counter ``name`` rose."""
    old = {labels["replica"]: v for labels, v in before.get(name, ())
           if labels.get("deployment") == deployment}
    return {labels["replica"] for labels, v in after.get(name, ())
            if labels.get("deployment") == deployment and v > old.get(labels["replica"], 0)}


def _by_replica(series, name, deployment) -> dict[str, float]:
    return {labels["replica"]: v for labels, v in series.get(name, ())
            if labels.get("deployment") == deployment}


def test_every_replica_reports_its_own_series(app):
    url, port = app
    before = _scrape(port)
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
        if _delta(before, series, "ray_baton_request_success_total",
                  deployment="DecodeServer") == sent and \
                _delta(before, series, "ray_baton_requests_total") == sent:
            break
        time.sleep(1)
    d = lambda name, **match: _delta(before, series, name, **match)  # noqa: E731
    assert d("ray_baton_request_success_total", deployment="DecodeServer",
             finish_reason="length") == sent
    assert d("ray_baton_request_success_total",
             deployment="PrefillServer") == sent  # the prefill engine stops after one token
    assert d("ray_baton_requests_total", outcome="length") == sent  # the ingress
    assert d("ray_baton_generation_tokens_total",
             deployment="DecodeServer") == sent * 5  # the first of 6 comes from prefill
    assert d("ray_baton_generation_tokens_total", deployment="PrefillServer") == sent
    assert d("ray_baton_kv_transfer_bytes_total", side="received") == \
        d("ray_baton_kv_transfer_bytes_total", side="sent") > 0
    # Each decode replica reports its own pool: distinct replica tags, used + free = all blocks.
    decodes = _risen(before, series, "ray_baton_engine_steps_total", "DecodeServer")
    assert len(decodes) == 2
    used = _by_replica(series, "ray_baton_kv_blocks_used", "DecodeServer")
    free = _by_replica(series, "ray_baton_kv_blocks_free", "DecodeServer")
    assert all(used[r] + free[r] == NUM_BLOCKS - 1 for r in decodes)
    assert len(_risen(before, series, "ray_baton_requests_total", "Router")) == 2
    assert d("ray_baton_engine_step_seconds_count", deployment="PrefillServer") > 0
    # Counters only rise.
    again = _scrape(port)
    for name in ("ray_baton_request_success_total", "ray_baton_generation_tokens_total",
                 "ray_baton_prompt_tokens_total", "ray_baton_requests_total"):
        old = {tuple(sorted(labels.items())): v for labels, v in series[name]}
        new = {tuple(sorted(labels.items())): v for labels, v in again[name]}
        assert all(new[k] >= v for k, v in old.items()), name


DASHBOARD = ROOT / "deploy" / "grafana" / "baton.json"
# Counters Ray exports only once their event has happened (no failure, migration or preemption
# in this test's traffic): their names are checked against the code that declares them.
EVENT_COUNTERS = {"ray_baton_kv_transfer_failures_total": "baton_kv_transfer_failures",
                  "ray_baton_request_migrations_total": "baton_request_migrations",
                  "ray_baton_num_preemptions_total": '"num_preemptions"'}


def test_the_dashboard_queries_only_exported_metrics(app):
    url, port = app
    shared = list(range(3, 43))  # twice: the second finds its full blocks in the prefix cache
    for _ in range(2):
        resp = requests.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": shared, "max_tokens": 3, "temperature": 0})
        assert resp.status_code == 200
    queried = set(re.findall(r"ray_baton_[a-z0-9_]+", DASHBOARD.read_text()))
    assert len(queried) > 15
    deadline, missing = time.time() + 30, queried
    while missing and time.time() < deadline:
        missing = queried - set(_scrape(port)) - set(EVENT_COUNTERS)
        time.sleep(1)
    assert not missing
    code = "".join((ROOT / f).read_text() for f in ("deploy/metrics.py", "router/metrics.py"))
    for name, declared in EVENT_COUNTERS.items():
        assert name in queried and declared in code, name
