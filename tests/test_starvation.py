"""The bounded wait (``starvation_timeout_s``, engine/scheduler.py): a sequence never scheduled
that has waited the bound with every slot taken by its own priority preempts the running one with
the most output tokens among those that have run the bound since admitted; the victim waits right
behind it, is not preempted again before it has run the bound once re-admitted, a better priority
is never preempted, and greedy tokens stay those of each request generated alone."""

import time

import pytest

from engine import LLM, SamplingParams
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence
from tests.models import random_prompts

BS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _scheduler(clock, timeout=1.0, max_num_seqs=2, budget=64) -> Scheduler:
    return Scheduler(KVCacheManager(BlockPool(64), BS), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, starvation_timeout_s=timeout, clock=clock)


def _add(sched, clock, rid, max_tokens=100, priority=0, prompt_len=10) -> Sequence:
    """A sequence arriving now, with a prompt of its own (no prefix-cache sharing)."""
    seq = Sequence(rid, [ord(rid)] * prompt_len,
                   SamplingParams(max_tokens=max_tokens, priority=priority),
                   arrival_time=clock.t)
    sched.add(seq)
    return seq


def _step(sched):
    """One step, one token at a time (no pending tokens): every sequence due a token gets one,
    and ends at ``max_tokens``."""
    batch = sched.schedule()
    for seq in sched.advance(batch):
        seq.token_ids.append(7)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return batch


def _ids(seqs):
    return [s.request_id for s in seqs]


def test_a_starving_sequence_preempts_the_longest_one_of_its_priority():
    clock = Clock()
    sched = _scheduler(clock)
    a = _add(sched, clock, "a")
    for _ in range(3):
        _step(sched)
    b = _add(sched, clock, "b")
    _step(sched)
    assert _ids(sched.running) == ["a", "b"]
    assert (a.num_output_tokens, b.num_output_tokens) == (4, 1)
    clock.t = 10.0
    c = _add(sched, clock, "c", max_tokens=2)
    clock.t = 10.2
    d = _add(sched, clock, "d", max_tokens=2)
    clock.t = 10.9  # c has waited 0.9 s: it waits
    _step(sched)
    assert _ids(sched.waiting) == ["c", "d"] and sched.num_preemptions == 0
    clock.t = 11.0  # c has waited the bound: it takes the slot of a (the most output tokens)
    batch = _step(sched)
    assert c in batch.seqs and a not in batch.seqs and _ids(sched.running) == ["b", "c"]
    assert _ids(sched.waiting) == ["a", "d"]  # right behind c, in front of d (arrived later)
    assert a.num_computed_tokens == 0 and a.num_output_tokens == 5 and not a.block_ids
    assert (sched.num_starvation_preemptions, sched.num_preemptions) == (1, 1)
    assert c.scheduled_time == 11.0 and c.admitted_time == 11.0
    # c ends (2 tokens); a, at the head, takes its slot back at 11.1 (recompute).
    clock.t = 11.1
    _step(sched)
    assert c.is_finished
    _step(sched)
    assert _ids(sched.running) == ["b", "a"] and a.admitted_time == 11.1
    assert _ids(sched.waiting) == ["d"]
    # d has waited 1.3 s; a has the most output tokens but has run only 0.4 s since it was
    # re-admitted: b gives way instead (no ping-pong).
    clock.t = 11.5
    _step(sched)
    assert a.num_output_tokens > b.num_output_tokens
    assert _ids(sched.running) == ["a", "d"] and _ids(sched.waiting) == ["b"]
    assert sched.num_starvation_preemptions == 2
    clock.t = 12.0
    e = _add(sched, clock, "e", max_tokens=2)
    _step(sched)  # d ends
    _step(sched)  # b takes its slot back
    assert d.is_finished and _ids(sched.running) == ["a", "b"] and _ids(sched.waiting) == ["e"]
    clock.t = 13.0  # e starves; a has run 1.9 s since re-admitted: it may give way again
    _step(sched)
    assert _ids(sched.running) == ["b", "e"] and _ids(sched.waiting) == ["a"]
    assert sched.num_starvation_preemptions == 3 and e.scheduled_time == 13.0


def test_a_preempted_sequence_at_the_head_does_not_hold_back_a_starving_one():
    clock = Clock()
    sched = _scheduler(clock)
    a, b = _add(sched, clock, "a"), _add(sched, clock, "b")
    _step(sched)
    _step(sched)
    clock.t = 5.0
    _add(sched, clock, "c")
    clock.t = 5.5
    _add(sched, clock, "d")
    clock.t = 6.0
    _step(sched)  # c starves: a gives way (equal output tokens: the first admitted)
    assert _ids(sched.running) == ["b", "c"] and _ids(sched.waiting) == ["a", "d"]
    # d starves at 6.5 behind a (preempted, so never the one that preempts): d goes ahead of
    # it, b gives way (c has run only 0.5 s) and waits right behind d.
    clock.t = 6.5
    _step(sched)
    assert _ids(sched.running) == ["c", "d"] and _ids(sched.waiting) == ["b", "a"]
    assert sched.num_starvation_preemptions == 2
    # Nobody new: the two victims wait for a slot (they never preempt, having been scheduled).
    clock.t = 100.0
    _step(sched)
    assert _ids(sched.running) == ["c", "d"] and sched.num_starvation_preemptions == 2
    assert (a.num_output_tokens, b.num_output_tokens) == (2, 3)  # their tokens kept


def test_never_a_better_priority_nor_a_prefilling_sequence():
    clock = Clock()
    sched = _scheduler(clock)
    a = _add(sched, clock, "a", priority=-1)
    _step(sched)
    b = _add(sched, clock, "b", priority=0)
    for _ in range(3):
        _step(sched)
    assert a.num_output_tokens > b.num_output_tokens
    clock.t = 10.0
    c = _add(sched, clock, "c", priority=0)
    clock.t = 20.0
    _step(sched)  # a has more tokens but a better priority: b gives way
    assert _ids(sched.running) == ["a", "c"] and _ids(sched.waiting) == ["b"]
    assert c.scheduled_time == 20.0
    # Only better priorities running: a starving sequence waits.
    clock = Clock()
    sched = _scheduler(clock)
    for rid in "ab":
        _add(sched, clock, rid, priority=-1)
    _step(sched)
    d = _add(sched, clock, "d", priority=0)
    clock.t = 100.0
    _step(sched)
    assert _ids(sched.running) == ["a", "b"] and _ids(sched.waiting) == ["d"]
    assert sched.num_preemptions == 0 and d.scheduled_time is None
    # A running sequence still prefilling (a 40-token prompt in chunks of 32) is not preempted,
    # however long it has run; once decoding, it is.
    clock = Clock()
    sched = _scheduler(clock, max_num_seqs=1, budget=32)
    a = _add(sched, clock, "a", prompt_len=40)
    _step(sched)
    e = _add(sched, clock, "e")
    clock.t = 3.0
    _step(sched)  # a's last 8 prompt tokens (budget left for e, but no slot)
    assert _ids(sched.running) == ["a"] and a.num_output_tokens == 1
    assert sched.num_preemptions == 0 and e.scheduled_time is None
    _step(sched)
    assert _ids(sched.running) == ["e"] and _ids(sched.waiting) == ["a"]


def test_a_sequence_whose_pending_token_is_its_last_is_not_preempted():
    clock = Clock()
    sched = _scheduler(clock)
    a, b = _add(sched, clock, "a", max_tokens=3), _add(sched, clock, "b")
    _step(sched)
    _step(sched)
    batch = sched.schedule()
    for seq in sched.advance(batch):  # the engine one step ahead: the tokens are pending
        seq.add_pending(0)
    assert a.num_output_tokens == 3 and a.num_pending == 1  # its last token is on the way
    assert a.num_output_tokens == b.num_output_tokens
    _add(sched, clock, "c")
    clock.t = 5.0
    sched.schedule()
    assert _ids(sched.running) == ["a", "c"] and _ids(sched.waiting) == ["b"]
    assert b.num_pending == 1  # preempted with its token on the way: admitted again once known


def test_off_nothing_changes():
    clock = Clock()
    sched = _scheduler(clock, timeout=None)
    _add(sched, clock, "a")
    _add(sched, clock, "b")
    _step(sched)
    c = _add(sched, clock, "c")
    clock.t = 1000.0
    for _ in range(5):
        _step(sched)
    assert _ids(sched.running) == ["a", "b"] and _ids(sched.waiting) == ["c"]
    assert sched.num_preemptions == 0 and c.scheduled_time is None


# -- the engine ------------------------------------------------------------------------------
LONG = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = random_prompts([21, 37, 9], vocab=512, seed=5)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_engine_short_request_beside_long_ones_same_tokens(async_scheduling):
    alone = LLM("tiny", max_num_seqs=2, starvation_timeout_s=None,
                async_scheduling=async_scheduling)
    expected = [alone.generate([p], s)[0].token_ids
                for p, s in zip(PROMPTS, (LONG, LONG, SHORT))]
    llm = LLM("tiny", max_num_seqs=2, starvation_timeout_s=0.01,
              async_scheduling=async_scheduling)
    engine = llm.engine
    engine.add_request(PROMPTS[0], LONG, "long0")
    engine.add_request(PROMPTS[1], LONG, "long1")
    tokens, order = {}, []
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 8:
            engine.add_request(PROMPTS[2], SHORT, "short")
            time.sleep(0.02)  # past the bound: both for the short one and the long ones' run
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                order.append(out.request_id)
        steps += 1
    assert order[0] == "short" and sorted(order) == ["long0", "long1", "short"]
    assert [tokens[r] for r in ("long0", "long1", "short")] == expected
    assert engine.scheduler.num_starvation_preemptions == 1
    assert engine.pool.num_used_blocks == 0
    # Without the bound the short one waits for a long one to end.
    off = LLM("tiny", max_num_seqs=2, starvation_timeout_s=None,
              async_scheduling=async_scheduling)
    outs = off.generate(PROMPTS, [LONG, LONG, SHORT])
    assert [o.token_ids for o in outs] == expected
    assert off.engine.scheduler.num_preemptions == 0
