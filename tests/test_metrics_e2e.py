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
                         "prefill": {"num_replicas": 1, "num_cpus": 0.25},
                         "disaggregation": {"mode": "always"}}),
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


def _total(series, name, replicas: set[str], **match) -> float:
    """The sum of ``name`` over this app's replicas (the shared test cluster also exports the
    series of earlier tests' replicas, some of them only seconds later)."""
    return sum(v for labels, v in series.get(name, ())
               if labels.get("replica") in replicas
               and all(labels.get(k) == want for k, want in match.items()))


def _by_replica(series, name, replicas: set[str]) -> dict[str, float]:
    """``name`` summed per replica (over its other labels)."""
    sums: dict[str, float] = {}
    for labels, v in series.get(name, ()):
        if labels.get("replica") in replicas:
            sums[labels["replica"]] = sums.get(labels["replica"], 0.0) + v
    return sums


def test_every_replica_reports_its_own_series(app):
    url, port = app
    seen = {"ingress": set(), "decode": set(), "prefill": set()}
    sent, i, deadline = 0, 0, time.monotonic() + 60
    # Rounds until both ingress and both decode replicas have had some (three at least; HAProxy
    # may learn of the second ingress replica only after the app reports ready).
    while i < 3 or (time.monotonic() < deadline
                    and [len(seen[r]) for r in ("ingress", "decode")] != [2, 2]):
        for prompt in PROMPTS:
            resp = requests.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": f"{prompt} {i}", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "include_timing": True})
            assert resp.status_code == 200, resp.text
            for role, replica in resp.json()["usage"]["timing"]["replicas"].items():
                seen[role].add(replica)
            sent += 1
        i += 1
    assert [len(seen[r]) for r in ("ingress", "decode", "prefill")] == [2, 2, 1], seen
    refused = [requests.post(f"{url}/v1/completions", timeout=60, json=body).status_code
               for body in ({"prompt": "x", "max_tokens": -1}, {"prompt": "x", "model": "nope"})]
    assert refused == [400, 404]
    ours = set().union(*seen.values())
    total = lambda name, **match: _total(series, name, ours, **match)  # noqa: E731
    deadline, series = time.time() + 45, {}
    while time.time() < deadline:
        series = _scrape(port)
        # every replica reports once a second, each on its own clock: wait for all of them
        if total("ray_baton_request_success_total", deployment="DecodeServer") == sent and \
                total("ray_baton_request_success_total", deployment="PrefillServer") == sent and \
                total("ray_baton_requests_total") == sent and \
                total("ray_baton_responses_total") == sent + 2:
            break
        time.sleep(1)
    assert total("ray_baton_request_success_total", deployment="DecodeServer",
                 finish_reason="length") == sent
    assert total("ray_baton_request_success_total",
                 deployment="PrefillServer") == sent  # the prefill engine stops after one token
    assert total("ray_baton_requests_total", outcome="length") == sent  # the ingress
    assert total("ray_baton_generation_tokens_total",
                 deployment="DecodeServer") == sent * 5  # the first of 6 comes from prefill
    assert total("ray_baton_generation_tokens_total", deployment="PrefillServer") == sent
    assert total("ray_baton_kv_transfer_bytes_total", side="received") == \
        total("ray_baton_kv_transfer_bytes_total", side="sent") > 0
    # Each replica's own series: each decode replica's KV gauges are its pool (used + free =
    # all blocks), each replica counts its own share.
    used = _by_replica(series, "ray_baton_kv_blocks_used", seen["decode"])
    free = _by_replica(series, "ray_baton_kv_blocks_free", seen["decode"])
    assert set(used) == set(free) == seen["decode"]
    assert all(used[r] + free[r] == NUM_BLOCKS - 1 for r in used)
    steps = _by_replica(series, "ray_baton_engine_steps_total", seen["decode"])
    assert set(steps) == seen["decode"] and all(v > 0 for v in steps.values())
    per_ingress = _by_replica(series, "ray_baton_requests_total", seen["ingress"])
    assert set(per_ingress) == seen["ingress"] and sum(per_ingress.values()) == sent
    assert total("ray_baton_engine_step_seconds_count", deployment="PrefillServer") > 0
    # What each engine runs, as tags of a constant gauge.
    info = [labels for labels, v in series["ray_baton_engine_info"] if v == 1
            and labels.get("replica") in seen["decode"]]
    assert info and all(i["weights"] == "float32" and i["kv_cache_dtype"] == "float32"
                        for i in info)
    # Answers by status code; every request's queue time, once on each engine.
    assert [total("ray_baton_responses_total", protocol="http", code=c)
            for c in ("200", "400", "404")] == [sent, 1, 1]
    for role in ("DecodeServer", "PrefillServer"):
        assert total("ray_baton_request_queue_time_seconds_count", deployment=role) == sent
    # Counters only rise.
    again = _scrape(port)
    for name in ("ray_baton_request_success_total", "ray_baton_generation_tokens_total",
                 "ray_baton_prompt_tokens_total", "ray_baton_requests_total",
                 "ray_baton_responses_total"):
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
    code = "".join((ROOT / f).read_text()
                   for f in ("contracts/metrics.py", "router/ingress/metrics.py"))
    for name, declared in EVENT_COUNTERS.items():
        assert name in queried and declared in code, name


def test_the_dashboard_renders_from_recorded_scrapes(app, tmp_path):
    """The dashboard's PromQL evaluated over scrapes of Ray's export (how a GPU run draws its
    picture without Grafana): the latency, throughput, KV and transfer panels all get data."""
    from benchmarks.dashboard import Recorder, render
    url, port = app
    rec = Recorder(port, interval_s=1.0).start()
    time.sleep(2.5)
    for i in range(12):
        resp = requests.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i} again", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200
    time.sleep(5)  # Ray reports every second; the export lags a little more
    scrapes = rec.stop()
    counts = render(scrapes, tmp_path / "dashboard.png", rate_window_s=3)
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000
    for title in ("Time to first token", "Inter-token latency", "Throughput (tokens/s)",
                  "KV cache use per replica (blocks held by transfers: right axis)",
                  "KV transfer (GB/s)", "Hand-over time",
                  "Engine step time", "Queue time (arrival to first scheduling)"):
        assert counts[title] > 0, (title, counts)


def test_startup_progress_lines_name_every_deployment(app, capsys):
    """`baton serve` and `baton demo` print the start-up as Serve reports it (a line per change)
    until the app runs; here it is already running: one line."""
    from ray import serve

    from deploy.cli import startup_summary, watch_startup
    line, failed = startup_summary(serve.status(), ["baton"])
    assert failed is None
    assert line.startswith("baton running: ")
    for deployment, n in (("Router", 2), ("DecodeServer", 2), ("PrefillServer", 1)):
        assert f"{deployment} {n}/{n}" in line, line
    watch_startup(["baton"], timeout=30)
    assert capsys.readouterr().out.strip().endswith(line)
    assert "not deployed yet" in startup_summary(serve.status(), ["other"])[0]


def test_a_conversation_stays_on_the_decode_replica_that_holds_it(app):
    """The decode pool's router (``KVAwareRouter``) sends a conversation's later turns, through
    either ingress replica, to the decode replica whose cache holds its earlier turns: each turn
    finds the history there (cached tokens), and the hand-over moves only the rest."""
    url, _ = app
    history = " ".join(f"word{i}" for i in range(60))  # several full blocks
    seen, cached = set(), []
    for turn in range(5):
        history += f" turn {turn} says"
        resp = requests.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": history, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "include_timing": True})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        seen.add(usage["timing"]["replicas"]["decode"])
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert len(seen) == 1, seen
    assert all(c >= 16 * 3 for c in cached[1:]), cached
