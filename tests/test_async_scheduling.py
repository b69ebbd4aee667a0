"""The engine one step ahead (``async_scheduling``) gives exactly what it gives one step at a
time: tokens, logprobs, finish reasons and texts, through stops, preemption, chunked prefill,
prefix-cache hits and aborts; no pending placeholder ever reaches an output; no block leaks."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import GREEDY_DRAW
from engine.llm_engine import LaunchedStep
from engine.sequence import PENDING
from tests.models import random_prompts

PROMPTS = random_prompts([3, 16, 17, 40, 70], vocab=512, seed=21)


def _outputs(llm, prompts, params):
    """Tokens, finish and stop reasons, texts and logprobs."""
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text, o.logprobs)
            for o in llm.generate(prompts, params)]


def _same(got, want) -> bool:
    """Equal, logprobs within 1e-4 (batches differ between the two modes, so float sums may
    differ in the last bits)."""
    def close(a, b):
        return a == b or (a is not None and b is not None and len(a) == len(b)
                          and all(abs(x - y) < 1e-4 for x, y in zip(a, b)))
    return len(got) == len(want) and all(
        g[:4] == w[:4] and close(g[4], w[4]) for g, w in zip(got, want))


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=25, logprobs=True,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=12, stop=["e"]),
    ]


@pytest.fixture(scope="module")
def stop_token():
    """A token the greedy run of prompt 1 makes at its 6th step, so a stop on it cuts early."""
    out = LLM("tiny", async_scheduling=False).generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    return out.token_ids[5]


@pytest.mark.parametrize("engine_kw", [
    {},
    {"num_blocks": 7},  # 6 usable blocks: the 70-token prompt cannot reach 100 tokens
    {"max_num_batched_tokens": 7},  # chunked prefill
    {"max_num_seqs": 2},
], ids=["plain", "small-cache", "chunked", "two-seqs"])
def test_async_gives_the_same_outputs_as_one_step_at_a_time(engine_kw, stop_token):
    params = _mixed_params(stop_token)
    sync = LLM("tiny", async_scheduling=False, **engine_kw)
    ahead = LLM("tiny", async_scheduling=True, **engine_kw)
    expected = _outputs(sync, PROMPTS, params)
    assert expected[1][1] == "stop" and len(expected[1][0]) < 30  # the stop really cut it
    assert expected[4][1] == "stop" and expected[4][2] == "e"
    assert len(expected[3][0]) == 1
    assert _same(_outputs(ahead, PROMPTS, params), expected)
    # Second round: prompts extending the first ones hit the prefix cache.
    extended = [p + [9, 8, 7] * 6 for p in PROMPTS]
    assert _same(_outputs(ahead, extended, params), _outputs(sync, extended, params))
    for llm in (sync, ahead):
        assert llm.engine.pool.num_used_blocks == 0
        assert not llm.engine.has_unfinished_requests()


def test_async_gives_the_same_tokens_under_preemption():
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)] * 2
    sync = LLM("tiny", async_scheduling=False, num_blocks=10)
    ahead = LLM("tiny", async_scheduling=True, num_blocks=10)
    assert _same(_outputs(ahead, PROMPTS[1:], params), _outputs(sync, PROMPTS[1:], params))
    assert ahead.engine.scheduler.num_preemptions > 0
    assert ahead.engine.pool.num_used_blocks == 0


def test_no_pending_placeholder_reaches_an_output(stop_token):
    llm = LLM("tiny")
    engine = llm.engine
    for prompt, params in zip(PROMPTS, _mixed_params(stop_token)):
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PENDING not in out.new_token_ids
            assert len(out.new_token_ids) <= 1
        steps += 1
        assert steps < 200
    assert engine.pool.num_used_blocks == 0


def test_abort_while_its_step_runs_leaks_nothing():
    llm = LLM("tiny")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    keep = engine.add_request(PROMPTS[2], params)
    drop = engine.add_request(PROMPTS[3], params)
    early = [t for _ in range(4) for o in engine.step() if o.request_id == keep
             for t in o.new_token_ids]
    assert engine._running_step is not None
    assert engine.abort_request(drop)
    done = {keep: early}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != drop
            done[out.request_id] += out.new_token_ids
    alone = LLM("tiny", async_scheduling=False).generate([PROMPTS[2]], params)[0].token_ids
    assert done[keep] == alone
    assert engine.pool.num_used_blocks == 0


def test_blocks_for_a_push_wait_for_the_step_that_may_still_write_them():
    llm = LLM("tiny")
    engine = llm.engine
    waits = []

    class Running(LaunchedStep):
        def wait(self):
            waits.append(1)

    engine._running_step = Running(due=[], releases=engine.scheduler.num_releases)
    engine.reserve(PROMPTS[1], request_id="a")  # nothing released since the launch: no wait
    assert waits == []
    engine.abort_request("a")  # its blocks go back while the step runs
    engine.reserve(PROMPTS[1], request_id="b")
    assert waits == [1]
    engine.abort_request("b")
    engine._running_step = None
    assert engine.pool.num_used_blocks == 0


def _staggered_mixed(engine, tag: str) -> dict:
    """Requests joining one every 4 steps, plain greedy ones (nothing but the argmax asked),
    then one with a penalty reading the newest token from the device, a seeded sampled one with
    logprobs, and a greedy one with a stop id: steps of only plain greedy sequences, then not,
    then again. Returns {request id: tokens}."""
    params = [SamplingParams(temperature=0, max_tokens=36, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                             repetition_penalty=1.5, presence_penalty=0.5),
              SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[3])]
    pending, got, step = list(enumerate(zip(PROMPTS, params))), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 4 == 0:
            i, (prompt, p) = pending.pop(0)
            got[engine.add_request(prompt, p, request_id=f"{tag}{i}")] = []
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        step += 1
    return {k[len(tag):]: v for k, v in got.items()}


def test_greedy_steps_may_take_their_ids_from_one_buffer_the_next_overwrites():
    """On a GPU a decode graph of a step whose every sequence is plain greedy takes the argmax
    itself, into one buffer of sampled ids that the next such step reads its pending inputs
    from, then overwrites, and writes the ids into one of two host buffers taking turns, which
    the step after next overwrites (:class:`engine.cuda_graph.DecodeGraphs`). Stood in for
    around the CPU runner: the engine asks for it exactly on those steps, takes the buffers'
    ids as the step's tokens (no copy of its own), and a penalty or a mixed step after one reads
    the newest token from the device buffer before it is overwritten: the same tokens as an
    engine that samples every step."""
    reference = _staggered_mixed(LLM("tiny").engine, "ref")
    engine = LLM("tiny").engine
    runner, buffer, asked, taken = engine.runner, torch.full((64,), -1), [], []
    host, turn = [torch.full((64,), -1), torch.full((64,), -1)], [0]
    execute, run = runner.execute, runner.run

    def recording_execute(batch, prev_tokens=None, draws=None):
        plain = all(s.params.greedy and not s.params.changes_logits and s.params.logprobs is None
                    for s in batch.seqs)
        assert draws is None or draws == [GREEDY_DRAW] * len(batch.seqs)
        asked.append((draws is not None, plain))
        return execute(batch, prev_tokens, draws)

    def graph_like_run(step, prev_tokens=None, draws=None):
        if not (draws is not None and step.meta.is_decode_only):
            return run(step, prev_tokens)
        if prev_tokens is not None and prev_tokens.data_ptr() != buffer.data_ptr():
            buffer[:len(prev_tokens)] = prev_tokens  # the running step sampled elsewhere
        logits = run(step, None if prev_tokens is None else buffer)
        n, t = len(step.ids), turn[0]
        turn[0] ^= 1
        buffer[:n] = host[t][:n] = logits.argmax(-1)
        runner.sampled, runner.sampled_host = buffer[:n], host[t][:n]
        taken.append(n)
        return logits
    runner.execute, runner.run = recording_execute, graph_like_run
    copied = []
    to_host = engine._to_host
    engine._to_host = lambda t: copied.append(t) or to_host(t)
    assert _staggered_mixed(engine, "buf") == reference
    assert all(greedy == plain for greedy, plain in asked)
    flags = [greedy for greedy, _ in asked]
    assert taken and flags.index(False) > 0 and True in flags[flags.index(False):]  # both ways
    # the steps whose graph wrote their ids to the host copied nothing of their own
    assert not any(t is not None and t.data_ptr() == buffer.data_ptr() for t in copied)
    assert engine.pool.num_used_blocks == 0


def test_plain_draws_name_each_row_greedy_or_its_draw():
    """What the engine asks a decode graph to draw (:meth:`LLMEngine._plain_draws`): each row's
    inverse temperature (0 where greedy), a salt fixed for its sequence's life, different
    between sequences, and its top-k and top-p; nothing where a row asks more of the draw than
    its raw logits at a temperature cut to a top-k of at most ``TOP_K_MAX`` (a seed, a top-p
    without a top-k, a larger top-k, min-p, logprobs, a penalty) or the batch is past the
    graphs' rows."""
    from engine.cuda_graph import ARGMAX_MAX_ROWS
    from engine.sequence import Sequence
    from kernels.argmax import TOP_K_MAX
    engine = LLM("tiny").engine

    def seq(**kw):
        return Sequence("r", [1, 2, 3], SamplingParams(**kw))
    plain = [seq(temperature=0), seq(temperature=0.5), seq(temperature=2.0, top_k=-1, top_p=1.0),
             seq(temperature=0.7, top_k=1), seq(temperature=1e-6),
             seq(temperature=0.6, top_k=20, top_p=0.95), seq(temperature=1.0, top_k=TOP_K_MAX)]
    draws = engine._plain_draws(plain)
    assert [d.inv_temp for d in draws] == [0.0, 2.0, 0.5, 0.0, 0.0, 1 / 0.6, 1.0]  # 1e-6: greedy
    assert [(d.top_k, d.top_p) for d in draws][-3:] == [(0, 1.0), (20, 0.95), (TOP_K_MAX, 1.0)]
    salts = [d.salt for d in draws]
    assert salts[0] == salts[3] == salts[4] == 0 and len({salts[i] for i in (1, 2, 5, 6)}) == 4
    assert all(0 <= s < 2 ** 31 for s in salts)
    assert engine._plain_draws(plain[::-1]) == draws[::-1]  # a sequence's, whatever its row
    for kw in (dict(temperature=0.5, seed=3), dict(temperature=0.5, top_p=0.9),
               dict(temperature=0.5, top_k=TOP_K_MAX + 1), dict(temperature=0.5, min_p=0.1),
               dict(temperature=0, logprobs=1), dict(temperature=0.5, presence_penalty=0.5)):
        assert engine._plain_draws([plain[1], seq(**kw)]) is None, kw
    assert engine._plain_draws([seq(temperature=0) for _ in range(ARGMAX_MAX_ROWS + 1)]) is None


def test_sampled_steps_may_take_the_draws_of_their_graph():
    """On a GPU a decode graph draws a plain step's sampled rows itself (Philox keyed by the
    row's salt and position, cut to its top-k and top-p: :mod:`kernels.argmax`). Stood in for
    around the CPU runner with :func:`kernels.argmax.draw_reference`: the engine asks for it on
    steps of sampled rows at a temperature, or cut to a top-k and top-p, beside a greedy one;
    each sampled request's tokens after its first (the prompt step's, drawn by the sampler)
    are the stand-in's draws for its salt, position by position, requests of one prompt part
    ways (their salts differ), a request cut to its top 1 is greedy, and the greedy request's
    tokens are those it makes alone."""
    from kernels.argmax import draw_reference
    llm = LLM("tiny")
    engine = llm.engine
    runner, run, drawn = engine.runner, engine.runner.run, {}

    def graph_like_run(step, prev_tokens=None, draws=None):
        logits = run(step, prev_tokens)
        if draws is not None and step.meta.is_decode_only:
            n = len(step.ids)
            positions = step.host_rows(n)[1]
            inv_temp, salt, top_k, top_p = (torch.tensor(f) for f in zip(*draws))
            runner.sampled = draw_reference(logits, inv_temp, salt.int(), positions,
                                            top_k.int(), top_p)
            for d, pos, tok in zip(draws, positions.tolist(), runner.sampled.tolist()):
                if d.inv_temp:
                    drawn.setdefault(d.salt, []).append((pos, tok))
        return logits
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], greedy)[0].token_ids
    runner.run = graph_like_run
    params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=16, ignore_eos=True),
        greedy, SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)]
    tokens = [o.token_ids for o in llm.generate([PROMPTS[0]] * len(params), params)]
    by_salt = sorted([tok for _, tok in sorted(draws)] for draws in drawn.values())
    assert len(by_salt) == 3 and sorted(t[1:] for t in tokens[:3]) == by_salt
    assert len({tuple(t[1:]) for t in tokens[:3]}) == 3
    assert tokens[3] == tokens[4] == alone
    assert engine.pool.num_used_blocks == 0
