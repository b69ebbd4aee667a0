"""Overload is refused at once: with small bounds, a burst far beyond them gets HTTP 429 with
Retry-After (gRPC RESOURCE_EXHAUSTED) in well under a second of queueing, streaming too (the
status comes before any body), those beyond the app's bound from HAProxy itself, and every
admitted request completes with the offline tokens."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from engine import LLM, SamplingParams
from tests.conftest import shutdown_serve
from tests.models import random_prompts
from deploy.ray_env import free_port
from tests.test_serving_e2e import GRPC_SERVICER

pytestmark = pytest.mark.e2e
BURST = 12
PROMPTS = random_prompts([8 + i for i in range(BURST)], vocab=512, seed=81)
PARAMS = dict(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def app(ray_cluster):
    from ray import serve

    from deploy.app import build_app

    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app({
        "mode": "colocated", "engine": {"model": "tiny", "num_blocks": 256, "max_num_seqs": 2,
                   "starvation_timeout_s": 0.3},
        "decode": {"max_ongoing_requests": 3, "max_queued_requests": 1},
        "admission": {"retry_after_s": 2},
        "router": {"request_timeout_s": 60, "queue_timeout_s": 1.0}}),
        name="baton", route_prefix="/")
    yield f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    shutdown_serve()


@pytest.fixture(scope="module")
def offline():
    return [o.token_ids for o in LLM("tiny").generate(PROMPTS, SamplingParams(**PARAMS))]


def _stream(url, prompt):
    t0 = time.time()
    resp = requests.post(f"{url}/v1/completions", timeout=120, stream=True,
                         json={"prompt": prompt, "stream": True, **PARAMS})
    answered = time.time() - t0
    if resp.status_code != 200:
        return resp.status_code, answered, resp.headers.get("Retry-After"), resp.json()
    tokens = [t for line in resp.iter_lines() if line.startswith(b"data: {")
              for c in json.loads(line[6:]).get("choices", []) for t in c["token_ids"]]
    return 200, answered, None, tokens


def _until_haproxy_holds_the_bound(bound: int, timeout_s: float = 30.0) -> None:
    """The ingress publishes the app's bound to this node's HAProxy once it has counted the
    live decode replicas and HAProxy lists it (seconds after the app is up on a loaded host):
    the burst must not come before."""
    from router.ingress.haproxy import MAP_NAME, node_paths, read_map

    bounds = node_paths()[1].with_name(MAP_NAME)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        entries = read_map(bounds.read_text()) if bounds.exists() else {}
        if any(v.split(":")[0] == str(bound) and int(v.split(":")[2]) > time.time()
               for v in entries.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"HAProxy never held the bound {bound}: {entries}")


def test_a_burst_beyond_the_bounds_gets_fast_429s_and_the_rest_complete(app, offline):
    url, _ = app
    _until_haproxy_holds_the_bound(4)  # 1 decode replica x (3 ongoing + 1 queued)
    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(lambda p: _stream(url, p), PROMPTS))
    refused = [r for r in results if r[0] == 429]
    served = [(i, r) for i, r in enumerate(results) if r[0] == 200]
    assert refused and served and len(refused) + len(served) == BURST, [r[0] for r in results]
    for _, answered, retry, body in refused:
        assert retry == "2" and answered < 5
        assert body["error"]["code"] == 429 and "capacity" in body["error"]["message"]
    # Beyond the app's bound (1 decode replica x (3 ongoing + 1 queued)) HAProxy refuses
    # itself (deploy/haproxy_local.sh, router/ingress/haproxy.py), before the ingress.
    at_haproxy = [r for r in refused if "(4 requests open);" in r[3]["error"]["message"]]
    assert at_haproxy and all(answered < 1 for _, answered, _, _ in at_haproxy), refused
    for i, (_, _, _, tokens) in served:
        assert tokens == offline[i]


def test_grpc_refuses_with_resource_exhausted(app):
    import grpc

    from proto import baton_pb2, baton_pb2_grpc

    _, address = app
    with grpc.insecure_channel(address) as channel:
        stub = baton_pb2_grpc.BatonStub(channel)

        def call(prompt):
            req = baton_pb2.GenerateRequest(prompt_token_ids=prompt, **PARAMS)
            try:
                return len(list(stub.GenerateStream(req, timeout=120))), None
            except grpc.RpcError as err:
                return err.code(), err.details()

        with ThreadPoolExecutor(BURST) as pool:
            outcomes = list(pool.map(call, PROMPTS))
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and any(isinstance(o[0], int) for o in outcomes), outcomes
    assert all("retry after 2 s" in details for _, details in refused), refused


def test_a_short_request_beside_slot_filling_long_ones_starts_within_the_bounded_wait(
        app, offline):
    """Two long streams hold both sequence slots; a short request that reaches the engine
    waits the bounded wait (``starvation_timeout_s``, 0.3 s here: at the default 1 s, the long
    streams of tiny, 2,000 tokens, could end on an idle machine before it passed), then a long
    one yields its slot (preempted, recomputed): the short one ends while both long ones still
    run, and the long ones' tokens are the offline engine's."""
    url, _ = app
    long_params = dict(PARAMS, max_tokens=2000)
    expected = [o.token_ids for o in LLM("tiny").generate(PROMPTS[:2],
                                                           SamplingParams(**long_params))]
    ends = {}

    def long(i):
        resp = requests.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": PROMPTS[i], **long_params}).json()
        ends[i] = time.time()
        assert "choices" in resp, resp
        return resp["choices"][0]["token_ids"]

    with ThreadPoolExecutor(2) as pool:
        running = []
        for i in range(2):  # one at a time: Serve counts a burst as queued (bound: 1)
            running.append(pool.submit(long, i))
            time.sleep(0.3)  # then both are admitted and decoding
        t0 = time.time()
        short = requests.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[5], **PARAMS, "max_tokens": 4})
        short_done = time.time()
        tokens = [f.result(timeout=120) for f in running]
    assert short.status_code == 200, short.text
    assert short_done < min(ends.values()), (short_done - t0, ends)
    assert tokens == expected
