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


@pytest.mark.parametrize("mode, down, certain", [("always", False, True),
                                                  ("always", True, False),
                                                  ("auto", False, False),
                                                  ("never", False, False)])
def test_a_hand_over_is_certain_before_the_reservation_only_where_room_alone_decides(
        mode, down, certain):
    """``always`` hands every prompt over unless room is short, so the decode replica may send
    the hand-over before it reserves; ``auto`` reads its prefix cache and queue first, and a
    dead prefill pool keeps every prompt here."""
    placer = Placer(DisaggregationConfig(mode=mode))
    placer.prefill_down = down
    assert placer.remote_for_certain is certain
    if certain:
        assert placer.decide(10**6, 0).where == "remote" == placer.decide(1, 10**6).where


def test_an_inter_token_target_hands_over_what_would_stretch_the_step_past_it():
    """With ``itl_target_ms`` a prompt kept here by the short or saturated rule is handed over
    ('itl') when the step computing it would exceed the target; not before the step is
    measured, never when the prefill pool is down, and never outside ``auto``."""
    placer = _placer(itl_target_ms=20)
    assert placer.decide(50, 0, step_s=0.015).reason == "short"
    assert placer.decide(50, 0).reason == "short"  # not measured yet
    assert (placer.decide(50, 0, step_s=0.025).where,
            placer.decide(50, 0, step_s=0.025).reason) == ("remote", "itl")
    placer.sent(20000, now=1.0)  # saturated: a long prompt would stay here, but for the target
    assert placer.decide(5000, 0, step_s=0.015).reason == "saturated"
    assert placer.decide(5000, 0, step_s=0.5).reason == "itl"
    placer.prefill_down = True
    assert placer.decide(50, 0, step_s=0.5).reason == "prefill_down"
    never = Placer(DisaggregationConfig(mode="never", itl_target_ms=1))
    assert never.decide(50, 0, step_s=0.5).reason == "never"
    assert _placer().decide(50, 0, step_s=10.0).reason == "short"  # no target: Dynamo's rule


def test_step_cost_from_decode_steps_and_what_prompt_tokens_add():
    import torch

    from engine.step_cost import StepCost
    cost = StepCost(torch.device("cpu"))
    assert cost.estimate(100) is None
    cost.record(0.0, 0.010, 0)  # a 10 ms decode step
    cost.record(0.0, 0.030, 100)  # 100 prompt tokens made it 30 ms: 0.2 ms each
    assert cost.estimate(0) == pytest.approx(0.010)
    assert cost.estimate(50) == pytest.approx(0.020)
    cost.record(0.0, 0.020, 0)  # decode steps slow down: the average moves a fifth of the way
    assert cost.decode_s == pytest.approx(0.012)


def test_a_prompt_step_measured_no_slower_than_decode_is_not_a_cost_of_zero():
    import torch

    from engine.step_cost import RECENT, StepCost
    cost = StepCost(torch.device("cpu"))
    cost.record(0.0, 0.012, 100)  # a prompt step before any decode step waits for one
    cost.record(0.0, 0.015, 0)  # a slow decode step (a loaded host): 12 ms says nothing yet
    assert cost.prompt_token_s is None
    cost.record(0.0, 0.010, 0)  # the fastest decode step so far: 2 ms for 100 tokens
    assert cost.prompt_token_s == pytest.approx(0.00002)
    cost.record(0.0, 0.009, 50)  # faster than every recent decode step: dropped, not zero
    for _ in range(RECENT):
        cost.record(0.0, 0.010, 0)
    assert cost.prompt_token_s == pytest.approx(0.00002)
    assert cost.estimate(100) > cost.decode_s


def test_the_engine_measures_its_steps_as_it_runs():
    from engine import LLM, SamplingParams
    from tests.models import random_prompts
    llm = LLM("tiny", show_progress=False)
    llm.generate(random_prompts([40, 60]), SamplingParams(max_tokens=8, ignore_eos=True))
    cost = llm.engine.step_cost
    assert cost.decode_s > 0 and cost.prompt_token_s is not None
    assert cost.estimate(100) > cost.decode_s
