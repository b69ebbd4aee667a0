"""A decode replica killed mid-stream (SIGKILL) loses no request: its streams go on, on the other
replica or on the one Serve starts in its place, and every client gets one continuous stream with
exactly the tokens of an undisturbed run, greedy and seeded (the ingress re-submits each request
with the tokens it already has; draws are keyed by seed and position)."""

import json
import os
import signal
import threading
import time

import pytest
import requests

from engine import LLM, SamplingParams
from tests.models import random_prompts
from tests.test_serving_e2e import _free_port

pytestmark = pytest.mark.e2e
PROMPTS = random_prompts([10 + 3 * i for i in range(6)], vocab=512, seed=91)
MAX_TOKENS = 400
PARAMS = [dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4 + \
         [dict(temperature=0.9, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
          for i in range(2)]


@pytest.fixture(scope="module")
def expected():
    llm = LLM("tiny")
    return [o.token_ids for o in llm.generate(PROMPTS, [SamplingParams(**p) for p in PARAMS])]


def _deploy(decode_replicas: int) -> str:
    from ray import serve

    from deploy.app import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({
        "mode": "colocated", "engine": {"model": "tiny", "num_blocks": 512, "max_num_seqs": 8},
        "decode": {"num_replicas": decode_replicas, "num_cpus": 0.5},
        "router": {"request_timeout_s": 120}}), name="baton", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def _decode_pids() -> list[int]:
    from ray.thirdparty_files import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "ServeReplica:baton:DecodeServer" in " ".join(p.info["cmdline"] or [])]


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


def _migrations(url) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("baton_request_migrations_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("decode_replicas", [2, 1])
def test_killing_a_decode_replica_loses_no_stream(ray_cluster, expected, decode_replicas):
    from ray import serve

    url = _deploy(decode_replicas)
    try:
        got = [[] for _ in PROMPTS]
        errors = [[] for _ in PROMPTS]
        threads = [threading.Thread(target=_stream, args=(url, p, q, got[i], errors[i]))
                   for i, (p, q) in enumerate(zip(PROMPTS, PARAMS))]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while min(len(g) for g in got) < 20 and time.time() < deadline:
            time.sleep(0.05)
        pids = _decode_pids()
        assert len(pids) == decode_replicas and max(len(g) for g in got) < MAX_TOKENS
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=150)
        assert errors == [[] for _ in PROMPTS]
        for i, want in enumerate(expected):
            assert got[i] == want, f"stream {i}: {len(got[i])} tokens"
        assert _migrations(url) >= 1
    finally:
        serve.shutdown()
