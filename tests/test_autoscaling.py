"""The roles' autoscaling: Baton's policies for Ray Serve's autoscaler (their decisions from the
replicas' reports), the reports themselves, and the config that turns it on per role."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from contracts.role import autoscaling_stats
from deploy.autoscaling import DECODE_POLICY, PREFILL_POLICY, DecodePolicy, PrefillPolicy
from deploy.config import BatonConfig, RoleConfig
from engine.llm_engine import EngineStats
from engine.snapshot import EngineSnapshot


def _ctx(current: int, state=None, **metrics) -> SimpleNamespace:
    """An AutoscalingContext as far as the policies read it: per metric, replica -> value."""
    return SimpleNamespace(current_num_replicas=current, policy_state=state or {},
                           aggregated_metrics={k: dict(enumerate(v)) for k, v in metrics.items()})


def test_prefill_replicas_clear_the_queued_prompt_tokens_within_the_target():
    policy = PrefillPolicy(target_ttft_s=0.5)
    # 2 replicas at 4,000 prompt tokens/s: 6,000 queued tokens need 3 for 0.5 s
    n, state = policy(_ctx(2, queued_prompt_tokens=[3000, 3000],
                           tokens_per_step_second=[4000, 4000]))
    assert n == 3 and state["prefill_rate"] == 4000
    # idle replicas measure no rate: the one remembered is used
    n, state = policy(_ctx(3, state, queued_prompt_tokens=[5000, 0, 0],
                           tokens_per_step_second=[0, 0, 0]))
    assert n == 3
    assert policy(_ctx(3, state, queued_prompt_tokens=[0, 0, 0]))[0] == 1  # nothing queued
    assert policy(_ctx(2, {}, queued_prompt_tokens=[900]))[0] == 2  # no rate yet: hold
    with pytest.raises(ValueError):
        PrefillPolicy(target_ttft_s=0)


def test_decode_replicas_follow_kv_use_and_step_time_against_their_targets():
    policy = DecodePolicy(target_kv_usage=0.5, target_itl_ms=20)
    # KV at 0.9 of a 0.5 target on 2 replicas: 4 of them bring it under
    assert policy(_ctx(2, kv_cache_usage=[0.9, 0.9], step_ms=[5, 5], running=[10, 10]))[0] == 4
    # steps at 30 ms against 20: 3
    assert policy(_ctx(2, kv_cache_usage=[0.1, 0.1], step_ms=[30, 30], running=[4, 4]))[0] == 3
    # light load on 3 replicas: 1 would still be under both targets
    assert policy(_ctx(3, kv_cache_usage=[0.1] * 3, step_ms=[4] * 3, running=[1] * 3))[0] == 1
    assert policy(_ctx(3, kv_cache_usage=[0.0] * 3, running=[0] * 3))[0] == 1  # idle
    assert policy(_ctx(2))[0] == 2  # no report yet: hold
    with pytest.raises(ValueError):
        DecodePolicy(target_kv_usage=1.5)


def test_a_replica_reports_its_queue_kv_use_and_rates_over_the_interval():
    stats = EngineStats(steps=10, step_seconds=0.5, scheduled_tokens=1000)
    snap = EngineSnapshot(running=3, waiting=2, queued_prompt_tokens=700, kv_blocks_used=25,
                          kv_blocks_free=75, stats=stats)
    first, previous = autoscaling_stats(snap, None)
    assert first == {"queued_prompt_tokens": 700, "kv_cache_usage": 0.25, "running": 3,
                     "waiting": 2}  # no interval yet: no rates
    later = replace(snap, stats=EngineStats(steps=30, step_seconds=1.5, scheduled_tokens=5000))
    report, _ = autoscaling_stats(later, previous)
    assert report["step_ms"] == pytest.approx(50.0)  # 1 s over 20 steps
    assert report["tokens_per_step_second"] == pytest.approx(4000.0)
    assert all(isinstance(v, float) for v in report.values())  # Serve refuses anything else


def test_a_roles_autoscaling_config_is_serves_with_batons_policy_by_default():
    from deploy.app import _options

    cfg = BatonConfig(prefill={"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}},
                      decode={"autoscaling_config": {
                          "min_replicas": 1, "max_replicas": 2, "policy": {
                              "policy_function": DECODE_POLICY,
                              "policy_kwargs": {"target_kv_usage": 0.5}}}})
    prefill = _options(cfg, "prefill", "router.replica_choice:KVAwareRouter")
    assert "num_replicas" not in prefill
    assert prefill["autoscaling_config"]["policy"] == {"policy_function": PREFILL_POLICY}
    decode = _options(cfg, "decode", "router.replica_choice:KVAwareRouter")
    assert decode["autoscaling_config"]["policy"]["policy_kwargs"] == {"target_kv_usage": 0.5}
    assert _options(BatonConfig(), "decode",
                    "router.replica_choice:KVAwareRouter")["num_replicas"] == 1
    # the targets alone (no policy_function): still Baton's policy, with them
    cfg = BatonConfig(decode={"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4,
        "policy": {"policy_kwargs": {"target_kv_usage": 0.5}}}})
    decode = _options(cfg, "decode", "router.replica_choice:KVAwareRouter")
    assert decode["autoscaling_config"]["policy"] == {
        "policy_function": DECODE_POLICY, "policy_kwargs": {"target_kv_usage": 0.5}}


def test_the_policies_skip_reports_that_are_not_numbers():
    nan, inf = float("nan"), float("inf")
    assert DecodePolicy()(_ctx(2, kv_cache_usage=[nan, 0.35], step_ms=[inf, 10.0],
                               running=[nan, 4.0]))[0] == 1
    assert PrefillPolicy()(_ctx(1, queued_prompt_tokens=[8000, nan, inf],
                                tokens_per_step_second=[2000, nan]))[0] == 4


def test_serve_takes_the_policies_with_their_targets():
    """Serve pickles a policy's module by value into its controller and makes the class with
    ``policy_kwargs``: that works for these."""
    from ray import cloudpickle
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=4, policy={
        "policy_function": PREFILL_POLICY, "policy_kwargs": {"target_ttft_s": 2.0}})
    cls = cloudpickle.loads(cloudpickle.dumps(config.policy.get_policy()))
    policy = cls(**config.policy.policy_kwargs)
    assert policy.target_ttft_s == 2.0
    assert policy(_ctx(1, queued_prompt_tokens=[8000], tokens_per_step_second=[1000]))[0] == 4


@pytest.mark.parametrize("role, message", [
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}, "exclude each other"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas"),
    ({"autoscaling_config": {"min_replicas": 1, "max_replica": 4}}, "max_replica"),  # a typo
])
def test_a_wrong_autoscaling_config_is_refused_when_the_config_is_read(role, message):
    with pytest.raises(ValidationError, match=message):
        RoleConfig(**role)


@pytest.mark.parametrize("kwargs, message", [({"target_kv_usage": 5}, "target_kv_usage"),
                                             ({"target_kv": 0.5}, "target_kv")])
def test_a_baton_policys_wrong_targets_are_refused_when_the_config_is_read(kwargs, message):
    with pytest.raises(ValidationError, match=f"decode.autoscaling_config.policy.policy_kwargs"
                                              f".*{message}"):
        BatonConfig(decode={"autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "policy": {"policy_kwargs": kwargs}}})


def _replicas(deployment: str) -> int:
    """A pool as Serve's autoscaler set it: replicas starting or running."""
    from ray import serve

    states = serve.status().applications["baton"].deployments[deployment].replica_states
    return sum(n for state, n in states.items() if state in ("STARTING", "RUNNING"))


def _until_one_replica(replicas) -> None:
    """Idle, the pool shrinks back to one replica (within a minute)."""
    import time

    deadline = time.time() + 60
    while replicas() != 1 and time.time() < deadline:
        time.sleep(0.5)
    assert replicas() == 1


@pytest.mark.e2e
def test_a_loaded_decode_pool_grows_and_shrinks_back_when_idle(ray_cluster):
    """A colocated app whose decode pool autoscales (1 to 2 replicas, KV target low enough that
    eight streams pass it): the streams (in waves until then) bring a second replica, every
    stream completes with the tokens of an undisturbed run, and once idle the pool is one
    replica again."""
    import threading
    import time

    import requests
    from ray import serve

    from deploy.app import build_app
    from deploy.ray_env import free_port
    from engine import LLM, SamplingParams
    from tests.conftest import shutdown_serve
    from tests.models import random_prompts

    prompts = random_prompts([20 + i for i in range(8)], vocab=512, seed=5)
    params = dict(temperature=0, max_tokens=600, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny").generate(prompts, SamplingParams(**params))]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"mode": "colocated",
                         "engine": {"model": "tiny", "num_blocks": 256, "max_num_seqs": 8},
                         "decode": {"num_cpus": 0.5, "autoscaling_config": {
                             "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0,
                             "downscale_delay_s": 2, "look_back_period_s": 2,
                             "metrics_interval_s": 0.5,
                             "policy": {"policy_function": "deploy.autoscaling:DecodePolicy",
                                        "policy_kwargs": {"target_kv_usage": 0.05}}}}}),
              name="baton", route_prefix="/")
    url = f"http://127.0.0.1:{port}"

    def replicas() -> int:
        return _replicas("DecodeServer")

    got = [None] * len(prompts)

    def run(i):
        got[i] = requests.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompts[i], **params}).json()["choices"][0]["token_ids"]

    try:
        assert replicas() == 1
        most, deadline = 1, time.time() + 90
        # Waves of the eight streams until the pool has grown: a fast host may finish a wave
        # before the autoscaler has seen a report of it (look-back 2 s, reports every 0.5 s).
        while most < 2 and time.time() < deadline:
            got[:] = [None] * len(prompts)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads) and time.time() < deadline:
                most = max(most, replicas())
                time.sleep(0.5)
            for t in threads:
                t.join(timeout=60)
            assert got == expected
        assert most == 2
        _until_one_replica(replicas)
    finally:
        shutdown_serve()


@pytest.mark.e2e
def test_a_prefill_heavy_load_grows_the_prefill_pool_and_idle_shrinks_it(ray_cluster):
    """A disaggregated app whose prefill pool autoscales (1 to 2 replicas, a TTFT target so
    small that any queued prompt passes it), every prompt handed over: clients that keep long
    prompts coming bring a second prefill replica, every answer has the offline engine's
    tokens, and once idle the pool is one replica again."""
    import threading
    import time

    import requests
    from ray import serve

    from deploy.app import build_app
    from deploy.ray_env import free_port
    from engine import LLM, SamplingParams
    from tests.conftest import shutdown_serve
    from tests.models import random_prompts

    prompts = random_prompts([1200 + 7 * i for i in range(8)], vocab=512, seed=9)
    params = dict(temperature=0, max_tokens=2, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny").generate(prompts, SamplingParams(**params))]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Every prompt computed again each time, in chunks of 64 tokens: a queue the reports see.
    engine = {"model": "tiny", "num_blocks": 512, "max_num_seqs": 8,
              "enable_prefix_caching": False, "max_num_batched_tokens": 64}
    serve.run(build_app({
        "mode": "disaggregated", "engine": engine, "disaggregation": {"mode": "always"},
        "decode": {"num_cpus": 0.25},
        "prefill": {"num_cpus": 0.25, "autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 2,
            "look_back_period_s": 2, "metrics_interval_s": 0.5,
            "policy": {"policy_function": "deploy.autoscaling:PrefillPolicy",
                       "policy_kwargs": {"target_ttft_s": 1e-6}}}}}),
        name="baton", route_prefix="/")
    url = f"http://127.0.0.1:{port}"

    def replicas() -> int:
        return _replicas("PrefillServer")

    stop, wrong = threading.Event(), []

    def client(i):
        while not stop.is_set():
            body = requests.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": prompts[i], **params}).json()
            if body.get("choices", [{}])[0].get("token_ids") != expected[i]:
                wrong.append(body)

    try:
        assert replicas() == 1
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while replicas() < 2 and time.time() < deadline:
            time.sleep(0.5)
        grown = replicas()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert grown == 2 and not wrong, wrong[:1]
        _until_one_replica(replicas)
    finally:
        shutdown_serve()
