"""Replicas that die or freeze under load lose no request.

A decode replica killed mid-stream (SIGKILL): its streams go on, on the other replica or on the
one Serve starts in its place, and every client gets one continuous stream with exactly the
tokens of an undisturbed run, greedy and seeded (the ingress re-submits each request with the
tokens it already has; draws are keyed by seed and position). The only prefill replica frozen
(SIGSTOP) or killed: every request is prefilled by its decode replica instead, at the latest at
the transfer deadline, with the same tokens; a frozen replica that wakes gives its blocks back,
and the woken or restarted replica prefills for the decode replica again."""

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from benchmarks.lib import migrations
from benchmarks.lib import replica_pids as _pids
from contracts.streamed import EARLY_CLAIM_S
from engine import LLM, SamplingParams
from tests.conftest import shutdown_serve
from tests.models import random_prompts
from deploy.ray_env import free_port

pytestmark = pytest.mark.e2e
PROMPTS = random_prompts([10 + 3 * i for i in range(6)], vocab=512, seed=91)
MAX_TOKENS = 1200  # streams long enough (~2 s on CI) that a kill lands mid-stream
# A split decode replica's streams: the kill comes as soon as every stream has its first
# tokens (no window to find the busiest replica), and every token after it is decoded again
# over two gloo ranks, so shorter streams keep the kill mid-stream and the test short.
SPLIT_MAX_TOKENS = 400
BURST = 12  # new requests sent at once right after an ingress replica's death
PARAMS = [dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4 + \
         [dict(temperature=0.9, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
          for i in range(2)]


@pytest.fixture(scope="module")
def expected():
    llm = LLM("tiny")
    return [o.token_ids for o in llm.generate(PROMPTS, [SamplingParams(**p) for p in PARAMS])]


ENGINE = {"model": "tiny", "num_blocks": 512, "max_num_seqs": 8}


def _config(decode_replicas: int, disaggregated: bool = False, prefill_replicas: int = 1,
            ranks: int = 1) -> dict:
    """``ranks``: the decode replicas' tensor-parallel size."""
    config = {"mode": "colocated", "engine": ENGINE,
              "decode": {"num_replicas": decode_replicas, "num_cpus": 0.5,
                         "tensor_parallel_size": ranks},
              "router": {"request_timeout_s": 120}}
    if disaggregated:
        config |= {"mode": "disaggregated",
                   "prefill": {"num_replicas": prefill_replicas, "num_cpus": 0.5},
                   "transfer": {"timeout_s": 2},
                   "disaggregation": {"mode": "always"}}  # the hand-over under test
    return config


def _deploy(decode_replicas: int, disaggregated: bool = False, prefill_replicas: int = 1,
            ranks: int = 1) -> str:
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(_config(decode_replicas, disaggregated, prefill_replicas, ranks)),
              name="baton", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def _start_streams(url, until_tokens: int = 20, max_tokens: int = MAX_TOKENS):
    """Every prompt's stream on its own thread, ``max_tokens`` long; returns once each has
    ``until_tokens`` tokens (and none has all of them)."""
    got = [[] for _ in PROMPTS]
    errors = [[] for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(url, p, {**q, "max_tokens": max_tokens},
                                                      got[i], errors[i]))
               for i, (p, q) in enumerate(zip(PROMPTS, PARAMS))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while min(len(g) for g in got) < until_tokens and time.time() < deadline:
        time.sleep(0.05)
    assert max(len(g) for g in got) < max_tokens
    return threads, got, errors


def _join_streams(threads, got, errors, expected, max_tokens: int = MAX_TOKENS) -> None:
    """Wait for the streams; each ended without an error and with exactly the undisturbed
    run's first ``max_tokens`` tokens (greedy, or seeded: a draw is keyed by seed and
    position, so a shorter run's tokens are the longer one's first)."""
    for t in threads:
        t.join(timeout=150)
    assert errors == [[] for _ in PROMPTS]
    for i, want in enumerate(expected):
        assert got[i] == want[:max_tokens], f"stream {i}: {len(got[i])} tokens"


def _migrated(url, timeout_s: float = 10.0) -> bool:
    """Whether the ingress has counted a moved stream: it counts a stream's moves when its
    handler ends, which can come a moment after the client has read the stream's last bytes."""
    deadline = time.time() + timeout_s
    while migrations(url) < 1 and time.time() < deadline:
        time.sleep(0.1)
    return migrations(url) >= 1


def _decode_pids() -> list[int]:
    return _pids("DecodeServer")


def _busiest(pids: list[int], window_s: float = 0.25) -> int:
    """The process that used the most CPU over a short window: with two decode replicas, one
    that is decoding streams (the router may have put them all on one replica)."""
    from ray.thirdparty_files import psutil

    procs = [psutil.Process(pid) for pid in pids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(window_s)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
    return pids[used.index(max(used))]


def _stream(url, prompt, params, got: list, errors: list):
    try:
        resp = requests.post(f"{url}/v1/completions", timeout=180, stream=True,
                             json={"prompt": prompt, "stream": True, **params})
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                for choice in event.get("choices", []):
                    got.extend(choice["token_ids"])
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(repr(exc))


@pytest.mark.parametrize("decode_replicas", [2, 1])
def test_killing_a_decode_replica_loses_no_stream(ray_cluster, expected, decode_replicas):
    url = _deploy(decode_replicas)
    try:
        threads, got, errors = _start_streams(url)
        pids = _decode_pids()
        assert len(pids) == decode_replicas
        os.kill(_busiest(pids), signal.SIGKILL)  # one that carries streams
        _join_streams(threads, got, errors, expected)
        assert _migrated(url)
        _assert_decode_idle()
    finally:
        shutdown_serve()


def test_the_only_decode_replica_killed_the_prefill_replica_decodes(ray_cluster, expected):
    """1P1D, the decode replica SIGKILLed mid-stream: its streams go on, whole, on the prefill
    replica (same tokens), a request sent after the kill is served there within 5 s, and once
    Serve has started a new decode replica, requests go to it again."""
    url = _deploy(1, disaggregated=True)
    try:
        threads, got, errors = _start_streams(url)
        (pid,) = _decode_pids()
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        body = requests.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], **PARAMS[0], "max_tokens": 8}).json()
        assert time.time() - t0 < 5, body
        assert body["usage"]["prefilled"] == {"where": "local", "reason": "decode_down"}, body
        _join_streams(threads, got, errors, expected)
        assert _migrated(url)
        deadline, why = time.time() + 90, "decode_down"
        while why == "decode_down" and time.time() < deadline:  # the new decode replica
            body = requests.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPTS[1], **PARAMS[0], "max_tokens": 4}).json()
            assert "usage" in body, body
            why = body["usage"]["prefilled"]["reason"]
            time.sleep(0.5)
        assert why == "always" and body["usage"]["kv_transfer"]["blocks_sent"] > 0
        _assert_decode_idle()
        assert _prefill_used_blocks() == 0
    finally:
        shutdown_serve()


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_a_split_decode_replica_serves_and_a_dead_rank_loses_no_stream(ray_cluster, expected,
                                                                       layout):
    """A decode replica whose model is split over 2 ranks (tensor parallelism, gloo), colocated
    or handed over to by a prefill replica of one rank (each decode rank gets its KV heads),
    streams the tokens of one rank; killing its second rank mid-stream fails the replica's
    engine, Serve replaces it, every stream goes on there (prefilled again) with exactly the
    undisturbed run's tokens, and no block stays held on either role."""
    from ray.thirdparty_files import psutil

    disaggregated = layout == "disaggregated"
    url = _deploy(1, disaggregated=disaggregated, ranks=2)
    try:
        threads, got, errors = _start_streams(url, max_tokens=SPLIT_MAX_TOKENS)
        (pid,) = _decode_pids()
        ranks = [c for c in psutil.Process(pid).children()
                 if "multiprocessing.spawn" in " ".join(c.cmdline())
                 and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(ranks) == 1, [c.cmdline() for c in ranks]
        ranks[0].kill()
        _join_streams(threads, got, errors, expected, SPLIT_MAX_TOKENS)
        assert _migrated(url)
        _assert_decode_idle()
        if disaggregated:
            assert _prefill_used_blocks() == 0 and _kv_load("PrefillServer")["held_blocks"] == 0
    finally:
        shutdown_serve()


def _kv_load(deployment: str) -> dict:
    from deploy.ray_env import driver_handle

    return driver_handle(deployment).kv_load.remote().result(timeout_s=30)


def _assert_decode_idle(timeout_s: float = 30.0) -> None:
    """The KV gauges of the decode replicas (asked a few times: Serve picks one per call) are
    back to idle: no block in use, none held for a transfer."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        loads = [_kv_load("DecodeServer") for _ in range(4)]
        if all(x["used_blocks"] == 0 and x["held_blocks"] == 0 for x in loads):
            return
        time.sleep(0.2)
    raise AssertionError(f"decode replicas not idle: {loads}")


def _prefill_used_blocks() -> int:
    return _kv_load("PrefillServer")["used_blocks"]


@pytest.mark.parametrize("how, prefill_replicas", [("SIGSTOP", 1), ("SIGKILL", 1), ("SIGKILL", 2)])
def test_a_lost_prefill_replica_is_replaced_by_local_prefill(ray_cluster, expected, how,
                                                             prefill_replicas):
    url = _deploy(1, disaggregated=True, prefill_replicas=prefill_replicas)
    try:
        warm = requests.post(f"{url}/v1/completions", timeout=60,
                             json={"prompt": PROMPTS[0], **PARAMS[0], "max_tokens": 4}).json()
        assert warm["usage"]["kv_transfer"]["blocks_sent"] > 0  # prefilled over there
        pids = _pids("PrefillServer")
        assert len(pids) == prefill_replicas
        pid = pids[0]
        os.kill(pid, getattr(signal, how))
        t0 = time.time()
        _join_streams(*_start_streams(url, until_tokens=0), expected)
        assert time.time() - t0 < 90
        if how == "SIGSTOP":
            # It wakes with pushes past their deadline, and with hand-overs sent ahead of their
            # calls while it slept: those whose leases have not ended yet it computes, and,
            # never claimed, drops within EARLY_CLAIM_S (CI once caught one holding blocks).
            os.kill(pid, signal.SIGCONT)
            settled, deadline = time.time() + EARLY_CLAIM_S + 1, time.time() + 30
            while (_prefill_used_blocks() or time.time() < settled) and time.time() < deadline:
                time.sleep(0.2)
            assert _prefill_used_blocks() == 0
        elif prefill_replicas == 1:  # Serve starts a new one: a new peer, used in its turn
            deadline = time.time() + 90
            while _pids("PrefillServer") in ([], [pid]) and time.time() < deadline:
                time.sleep(0.5)
        deadline, sent = time.time() + 60, 0
        while not sent and time.time() < deadline:  # until Serve routes to it again
            body = requests.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPTS[1], **PARAMS[0], "max_tokens": 4}).json()
            assert "usage" in body, body
            sent = (body["usage"]["kv_transfer"] or {}).get("blocks_sent", 0)
            time.sleep(0.5)
        assert sent > 0  # prefilled over there again, not here
        _assert_decode_idle()
    finally:
        shutdown_serve()


def test_a_redeploy_that_scales_decode_down_cuts_no_stream(ray_cluster, expected):
    """``serve.run`` again with one decode replica instead of two while streams run: the one
    Serve stops drains (its streams finish there, or move once it is gone) and the ingress keeps
    every client's stream."""
    from ray import serve

    from deploy.app import build_app

    url = _deploy(2)
    try:
        threads, got, errors = _start_streams(url)
        serve.run(build_app(_config(1)), name="baton", route_prefix="/")
        _join_streams(threads, got, errors, expected)
        deadline = time.time() + 60
        while len(_decode_pids()) != 1 and time.time() < deadline:
            time.sleep(0.2)
        assert len(_decode_pids()) == 1
    finally:
        shutdown_serve()


def test_killing_an_ingress_replica_cuts_only_its_own_streams(ray_cluster, expected):
    """The ingress holds its clients' connections, so its death ends their streams (as any HTTP
    server's would); the streams on the other ingress replica go on exactly, and new requests
    are served at once by the survivor, not after the restart."""
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = _config(1) | {"router": {"num_replicas": 2, "request_timeout_s": 120}}
    serve.run(build_app(config), name="baton", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    try:
        # HAProxy learns of each ingress replica on its own schedule: until both answer, every
        # stream could land on one of them, and killing it would cut them all.
        seen, deadline = set(), time.time() + 60
        while len(seen) < 2 and time.time() < deadline:
            body = requests.post(f"{url}/v1/completions", timeout=30, json={
                "prompt": PROMPTS[0], **PARAMS[0], "max_tokens": 1, "include_timing": True})
            seen.add(body.json()["usage"]["timing"]["replicas"]["ingress"])
        assert len(seen) == 2
        threads, got, errors = _start_streams(url)
        routers = _pids("Router")
        assert len(routers) == 2
        os.kill(routers[0], signal.SIGKILL)
        t0 = time.time()
        # New requests in the moment of the death (those sent within ~30 ms of it met the dead
        # replica: before deploy/haproxy_local.sh buffered requests, 1-6 of 16 such got a 502
        # or a connection closed without a response, every time): each is answered, by the
        # other replica, at once.
        with ThreadPoolExecutor(BURST) as pool:
            answers = list(pool.map(lambda _: requests.post(
                f"{url}/v1/completions", timeout=30,
                json={"prompt": PROMPTS[0], **PARAMS[0], "max_tokens": 4}), range(BURST)))
        waited = time.time() - t0
        assert [a.status_code for a in answers] == [200] * BURST, \
            [a.text[:200] for a in answers if a.status_code != 200]
        assert all(a.json()["choices"][0]["token_ids"] == expected[0][:4] for a in answers)
        for t in threads:
            t.join(timeout=150)
        cut = [i for i, e in enumerate(errors) if e]
        assert len(cut) < len(PROMPTS)  # the other replica's streams went on
        for i, want in enumerate(expected):
            if i not in cut:
                assert got[i] == want, f"stream {i}: {len(got[i])} tokens"
        assert waited < 10, f"new requests waited {waited:.1f} s"
        _assert_decode_idle()
    finally:
        shutdown_serve()
