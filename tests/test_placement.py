"""The placement decision's arithmetic (``decode_worker.placement``), without servers."""

from __future__ import annotations

import pytest

from decode_worker.placement import BusyRate, DisaggregationConfig, Placer


def test_busy_rate_counts_calls_served_together_over_their_shared_time():
    """Four calls of 1,000 tokens sent at once and answered together after 0.4 s: the pool
    delivered 10,000 tokens/s (a per-call rate would say 2,500)."""
    rate = BusyRate()
    for _ in range(4):
        rate.start(1000, now=0.0)
    for _ in range(4):
        rate.finish(1000, now=0.4)
    assert rate.value == pytest.approx(10000)
    assert rate.outstanding == 0


def test_busy_rate_ignores_idle_time_and_forgets_old_work():
    rate = BusyRate(horizon_s=1.0)
    rate.start(100, now=0.0)
    rate.finish(100, now=1.0)  # 100 tokens/s
    rate.start(1000, now=50.0)  # 49 s idle: not counted
    rate.finish(1000, now=51.0)  # 1,000 tokens/s; the first second weighs half as much now
    assert rate.busy_s == pytest.approx(1.0)
    assert rate.value == pytest.approx(550)


def test_a_call_that_delivered_nothing_counts_as_time_only():
    rate = BusyRate()
    rate.start(100, now=0.0)
    rate.finish(100, delivered=False, now=1.0)
    assert rate.value is None and rate.outstanding == 0


def _placer(**kw) -> Placer:
    placer = Placer(DisaggregationConfig(max_local_prefill_length=100, **kw))
    placer.prefilled_here(1000, 1.0)  # 1,000 tokens/s here
    placer.sent(1000, now=0.0)
    placer.answered(1000, delivered=True, now=0.5)  # 2,000 tokens/s over there
    return placer


def test_short_here_long_there_while_the_pool_keeps_up():
    placer = _placer()
    assert placer.decide(50, 0).reason == "short"
    assert placer.decide(5000, 0).where == "remote"


def test_a_pool_busy_with_our_prompts_beyond_the_local_queue_is_saturated():
    placer = _placer()
    placer.sent(20000, now=1.0)  # 10 s of work queued there: later than 5 s here
    assert (placer.decide(5000, 0).where, placer.decide(5000, 0).reason) == \
        ("local", "saturated")
    assert placer.decide(5000, 20000).where == "remote"  # here is busier still


def test_an_idle_pool_is_never_saturated_whatever_its_measured_rate():
    """A slow rate measured once must not keep every prompt here for good: with nothing of
    ours outstanding, a long prompt goes to the pool (whose answer measures it again)."""
    placer = Placer(DisaggregationConfig(max_local_prefill_length=100))
    placer.prefilled_here(10000, 0.1)  # fast here
    placer.sent(1000, now=0.0)
    placer.answered(1000, delivered=True, now=10.0)  # 100 tokens/s there, once
    assert placer.decide(5000, 0).where == "remote"
    assert placer.counts == {("remote", "long"): 1}
