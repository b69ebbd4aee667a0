"""Same greedy tokens with prefix caching on/off, on cache hits, under chunked prefill and under
preemption; the hit counters move and no block leaks."""

import pytest

from engine import LLM, SamplingParams
from tests.models import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts([5, 16, 33, 40, 70], vocab=512, seed=3)


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny", enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _tokens(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _assert_no_leak(llm):
    assert llm.engine.pool.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_prefix_caching_on_gives_same_tokens_and_hits_on_second_batch(reference):
    llm = LLM("tiny", enable_prefix_caching=True)
    assert _tokens(llm) == reference
    pool = llm.engine.pool
    hits_before = pool.hit_tokens
    assert pool.num_cached_blocks > 0
    # Second batch: the same prompts (full hits) and prompts extending them (partial hits).
    extended = [p + [7, 8, 9, 10, 11] * 4 for p in PROMPTS]
    outs = llm.generate(PROMPTS + extended, GREEDY)
    assert [o.token_ids for o in outs[: len(PROMPTS)]] == reference
    assert pool.hit_tokens > hits_before
    for prompt, out in zip(PROMPTS + PROMPTS, outs):  # hits cover the original prompts' blocks
        assert out.num_cached_tokens == (len(prompt) // 16) * 16
    no_cache = LLM("tiny", enable_prefix_caching=False)
    assert [o.token_ids for o in outs[len(PROMPTS):]] == _tokens(no_cache, extended)
    _assert_no_leak(llm)


def test_generated_blocks_are_cached_for_a_follow_up_turn():
    llm = LLM("tiny")
    first = llm.generate([PROMPTS[3]], GREEDY)[0]
    follow_up = PROMPTS[3] + first.token_ids + [5, 6, 7]
    second = llm.generate([follow_up], GREEDY)[0]
    assert second.num_cached_tokens == (len(PROMPTS[3]) + len(first.token_ids) - 1) // 16 * 16
    assert second.token_ids == _tokens(LLM("tiny", enable_prefix_caching=False), [follow_up])[0]


@pytest.mark.parametrize("budget", [1, 7, 16, 33])
def test_chunked_prefill_gives_same_tokens(reference, budget):
    llm = LLM("tiny", max_num_batched_tokens=budget)
    assert _tokens(llm) == reference
    _assert_no_leak(llm)


def test_preemption_by_recompute_gives_same_tokens(reference):
    # 12 usable blocks of 16 tokens cannot hold five sequences of up to 94 tokens at once.
    llm = LLM("tiny", num_blocks=13)
    assert _tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_no_leak(llm)


def test_max_num_seqs_limits_the_running_batch(reference):
    llm = LLM("tiny", max_num_seqs=2)
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    _assert_no_leak(llm)


def test_a_reservation_that_finds_no_room_counts_no_prompt_tokens():
    """Refused (no slot): nothing is taken, and its prompt is counted only when the request
    comes back (prefilled here, or reserved again), not twice."""
    engine = LLM("tiny", max_num_seqs=1).engine
    assert engine.reserve(PROMPTS[0], GREEDY, "held") is not None
    counted = engine.stats.prompt_tokens
    assert engine.reserve(PROMPTS[1], GREEDY, "no-slot") is None
    assert engine.stats.prompt_tokens == counted
    engine.abort_request("held")


def test_sequences_awaiting_kv_count_against_max_num_seqs():
    """Decode role: reserved (transferring) sequences hold batch slots, so local requests never
    push the running batch past max_num_seqs once the transfers are admitted."""
    llm = LLM("tiny", max_num_seqs=3)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:2]):
        assert engine.reserve(p, GREEDY, f"t{i}") is not None
    for p in PROMPTS[2:]:
        engine.add_request(p, GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 1  # one slot left beside the two reservations
    for i in range(2):
        engine.admit(f"t{i}", 7)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) + len(engine.scheduler.transferring) <= 3
    _assert_no_leak(llm)


def test_a_queued_request_takes_a_first_token_made_elsewhere(reference):
    """Decode role with no room: a request still waiting takes the first token another engine
    sampled (published at once) and continues as a preempted one would, to the same tokens; a
    request that has started here, or is gone, refuses it; a first token that ends the request
    finishes it in the queue, leaving nothing behind."""
    llm = LLM("tiny", max_num_seqs=1, starvation_timeout_s=None)
    engine = llm.engine
    tokens: dict[str, list[int]] = {}

    def step():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    engine.add_request(PROMPTS[0], GREEDY, "r0")
    step()  # r0 runs in the one slot; r1 and r2 wait
    engine.add_request(PROMPTS[1], GREEDY, "r1")
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5), "r2")
    assert engine.take_first_token("r0", reference[0][0]) is None  # started here
    assert engine.take_first_token("nobody", 1) is None
    out = engine.take_first_token("r1", reference[1][0])
    assert out.new_token_ids == [reference[1][0]] and not out.finished
    assert engine.take_first_token("r1", reference[1][0]) is None  # once
    eos = next(iter(engine.updater.eos_token_ids))
    done = engine.take_first_token("r2", eos)
    assert done.finished and done.finish_reason == "stop"
    tokens["r1"] = [reference[1][0]]
    while engine.has_unfinished_requests():
        step()
    assert tokens["r0"] == reference[0] and tokens["r1"] == reference[1]
    assert "r2" not in tokens
    _assert_no_leak(llm)


def test_sequence_larger_than_the_whole_cache_ends_with_length():
    llm = LLM("tiny", num_blocks=3)  # two usable blocks: 32 tokens in all
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "length"
    # 32 tokens have KV in the two blocks; the last sampled token needs none.
    assert len(PROMPTS[1]) + len(out.token_ids) == 33
    _assert_no_leak(llm)


def test_priority_orders_the_waiting_queue_and_preemption(reference):
    """Lower ``priority`` is admitted first (equal ones in arrival order), takes the slot of a
    running sequence of a worse priority, and is preempted last; the tokens stay those of the
    run without priorities. (The bounded wait is off: on a slow machine r1 could otherwise
    preempt r0 after ``starvation_timeout_s``; tests/test_starvation.py tests it.)"""
    llm = LLM("tiny", max_num_seqs=1, starvation_timeout_s=None)
    engine = llm.engine
    order, tokens = [], {}
    engine.add_request(PROMPTS[0], GREEDY, "r0")
    engine.step()  # r0 runs in the one slot
    for i, p in enumerate(PROMPTS[1:4], 1):
        engine.add_request(p, GREEDY.model_copy(update={"priority": [0, -1, 1][i - 1]}), f"r{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                order.append(out.request_id)
    # r2 (priority -1) took r0's slot at once; r0, preempted, goes on before r1 (same priority,
    # earlier); r3 (priority 1) last.
    assert order == ["r2", "r0", "r1", "r3"]
    assert [tokens[f"r{i}"] for i in range(4)] == reference[:4]
    _assert_no_leak(llm)
    # Blocks for only some sequences: the worst priority is preempted, never the best.
    llm = LLM("tiny", num_blocks=13, starvation_timeout_s=None)
    sched, victims = llm.engine.scheduler, []
    preempt = sched._preempt
    sched._preempt = lambda seq: (victims.append(seq.params.priority), preempt(seq))
    prio = [1, 0, 1, 0, 1]
    outs = llm.generate(PROMPTS, [GREEDY.model_copy(update={"priority": p}) for p in prio])
    assert [o.token_ids for o in outs] == reference
    assert victims and set(victims) == {1}
    _assert_no_leak(llm)


def test_reset_prefix_cache_makes_a_replayed_prompt_a_miss(reference):
    llm = LLM("tiny")
    first = llm.generate(PROMPTS[4], GREEDY)[0]
    assert llm.engine.pool.num_cached_blocks > 0
    assert llm.engine.reset_prefix_cache() > 0 and llm.engine.pool.num_cached_blocks == 0
    hits = llm.engine.pool.hit_tokens
    again = llm.generate(PROMPTS[4], GREEDY)[0]
    assert llm.engine.pool.hit_tokens == hits and again.token_ids == first.token_ids


def test_a_steps_slots_are_its_tokens_places_in_their_blocks():
    """``ModelRunner.prepare`` writes a run of slots a block at a time: each token's slot is its
    block's id x block size + its place in the block, and -1 where the token is already in the
    cache (loaded from the host tier), for runs starting and ending anywhere in a block."""
    import random
    from types import SimpleNamespace

    from engine.draft_model import _View
    from engine.model_runner import ModelRunner
    from engine.scheduler import ScheduledBatch
    bs, rng = 4, random.Random(0)
    host = SimpleNamespace(block_size=bs, _as_rows=lambda batch: False)
    for _ in range(50):
        views, news, want = [], [], []
        for _ in range(3):
            start, n = rng.randrange(0, 20), rng.randrange(1, 20)
            table = rng.sample(range(1, 100), -(-(start + n) // bs))
            present = rng.choice([0, start, rng.randrange(start, start + n + 1)])
            views.append(_View(list(range(start + n)), table, start, start + n,
                               num_present_tokens=present))
            news.append(n)
            want += [-1 if p < present else table[p // bs] * bs + p % bs
                     for p in range(start, start + n)]
        assert ModelRunner.prepare(host, ScheduledBatch(views, news)).slots == want


def test_a_sequence_whose_last_token_is_pending_is_not_the_one_preempted():
    """A prefill-role request whose one token is on its way ends with its blocks held for the
    push: the preemption for a growing sequence takes another (here that sequence itself)."""
    llm = LLM("tiny", num_blocks=4, block_size=4, show_progress=False)
    e = llm.engine
    e.add_request([11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=100,
                                                   ignore_eos=True), "b")
    e.add_request(list(range(21, 29)), SamplingParams(temperature=0, max_tokens=1,
                                                      ignore_eos=True), "a", hold_blocks=True)
    ended = {}
    for _ in range(6):
        ended.update({o.request_id: o.finish_reason for o in e.step() if o.finished})
    assert ended.get("a") == "length" and len(e.held_blocks("a")) == 2
    assert e.scheduler.num_preemptions >= 1
    e.release_held_blocks("a")


def test_a_preempted_sequence_grown_past_the_cache_ends_instead_of_blocking_the_queue():
    """Preempted with a pending token that takes it past what the cache can ever hold: at the
    head of the queue it ends with ``length`` (as it would have running), and the requests
    behind it run."""
    from engine.sequence import Sequence

    llm = LLM("tiny", num_blocks=5, block_size=4, show_progress=False)  # 16 tokens at most
    sched = llm.engine.scheduler
    stuck = Sequence("stuck", list(range(30, 47)), SamplingParams(max_tokens=100))  # 17 tokens
    sched.add(stuck)  # (as a preempted sequence is queued: nothing computed, at the front)
    llm.engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2), "next")
    ended = {}
    for _ in range(8):
        ended.update({o.request_id: o.finish_reason for o in llm.engine.step() if o.finished})
    assert ended == {"stuck": "length", "next": "length"}
    _assert_no_leak(llm)


def test_an_id_whose_blocks_are_still_held_is_refused():
    """A prefill-role request ends with its blocks held for the push: its id is in use until
    they are released (a second run under it would take over, then free, the first's)."""
    from engine.errors import RequestIdInUse

    llm = LLM("tiny", show_progress=False)
    e = llm.engine
    e.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=1), "p", hold_blocks=True)
    while not any(o.finished for o in e.step()):
        pass
    held = e.held_blocks("p")
    with pytest.raises(RequestIdInUse):
        e.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=1), "p", hold_blocks=True)
    assert e.held_blocks("p") == held
    e.release_held_blocks("p")
    e.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=1), "p", hold_blocks=True)
