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
    prefill = _options(cfg, "prefill", "router.replica_choice:PrefixAwareRouter")
    assert "num_replicas" not in prefill
    assert prefill["autoscaling_config"]["policy"] == {"policy_function": PREFILL_POLICY}
    decode = _options(cfg, "decode", "router.replica_choice:LeastKVLoadRouter")
    assert decode["autoscaling_config"]["policy"]["policy_kwargs"] == {"target_kv_usage": 0.5}
    assert _options(BatonConfig(), "decode",
                    "router.replica_choice:LeastKVLoadRouter")["num_replicas"] == 1


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
])
def test_a_wrong_autoscaling_config_is_refused_when_the_config_is_read(role, message):
    with pytest.raises(ValidationError, match=message):
        RoleConfig(**role)
