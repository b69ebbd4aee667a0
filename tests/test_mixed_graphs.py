"""The piecewise path of steps that are not decode-only (engine.cuda_graph.MixedGraphs), checked
on the CPU with its pieces run as plain calls over the same static buffers the CUDA graphs use:
steps padded to a captured size, the model split around attention, prompt tokens beside decoding
sequences, chunked prefill, prefix-cache hits and prompt logprobs give the greedy tokens and
logprobs of the eager forward. (The captured graphs themselves: tests/test_gpu_engine.py.)"""

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.cuda_graph import MixedGraphs, graph_max_tokens, mixed_sizes, prompt_graph_max_tokens
from engine.llm_engine import LLMEngine
from tests.models import random_prompts


def test_the_largest_graphed_step_by_default_depends_on_the_weights():
    assert graph_max_tokens(None, fp8_weights=False) == 512
    assert graph_max_tokens(None, fp8_weights=True) == 2048
    assert graph_max_tokens(0, fp8_weights=True) == 0
    assert graph_max_tokens(100, fp8_weights=False) == 100


def test_mixed_sizes_pad_by_at_most_a_quarter():
    assert mixed_sizes(16) == [16]
    assert mixed_sizes(100) == [16, 32, 48, 64, 80, 96, 100]
    sizes = mixed_sizes(512)
    assert sizes[0] == 16 and sizes[-1] == 512 and 256 in sizes
    assert all(b - a <= a / 4 for a, b in zip(sizes[7:], sizes[8:]))
    sizes = mixed_sizes(2048)
    assert sizes[:16] == mixed_sizes(512) and sizes[-1] == 2048 and 1024 in sizes
    assert all(b - a <= a / 4 for a, b in zip(sizes[7:], sizes[8:]))
    assert all(b - a <= a / 8 for a, b in zip(sizes, sizes[1:]) if a >= 1024)


def test_lone_prompt_graphs_by_default_take_up_to_2048_tokens_within_the_step_budget():
    assert prompt_graph_max_tokens(None, 8192, 40960) == 2048
    assert prompt_graph_max_tokens(None, 256, 40960) == 256
    assert prompt_graph_max_tokens(0, 8192, 40960) == 0
    assert prompt_graph_max_tokens(2048, 8192, 40960) == 2048
    assert prompt_graph_max_tokens(2048, 1024, 40960) == 1024
    assert prompt_graph_max_tokens(None, 8192, 600) == 600  # no prompt is longer


def _engine(piecewise: bool, prompt_max: int = 0, **kw) -> LLMEngine:
    engine = LLMEngine(EngineConfig(**{**dict(model="tiny", show_progress=False, seed=0), **kw}))
    runner = engine.runner
    assert runner.mixed is None  # no piecewise graphs on the CPU by default
    if piecewise:
        runner.mixed = MixedGraphs(runner, 96, capture=False, prompt_max_tokens=prompt_max)
    return engine


def staggered(engine: LLMEngine, prompts, max_tokens=12, every=3, **params) -> dict:
    """Greedy; one prompt joins every ``every`` steps, so most prompts are prefilled in a step
    beside decoding sequences. Returns {request id: (tokens, logprobs, prompt logprobs)}."""
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                       **params)
    out, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(prompt, p, request_id=f"r{i}")
        for o in engine.step():
            rec = out.setdefault(o.request_id, [[], [], None])
            rec[0] += o.new_token_ids
            rec[1] += o.new_logprobs or []
            if o.prompt_logprobs is not None:
                rec[2] = o.prompt_logprobs
        step += 1
    return out


@pytest.mark.parametrize("budget", [8192, 40], ids=["whole-prompts", "chunked"])
def test_piecewise_steps_give_the_eager_tokens(budget):
    shared = random_prompts([48], seed=3)[0]
    prompts = random_prompts([30, 5, 70, 17, 120, 9], seed=4)
    prompts += [shared + [11, 12], shared + [13]]  # the second one hits the first's blocks
    runs = [staggered(_engine(pw, max_num_batched_tokens=budget), prompts) for pw in (True,
                                                                                       False)]
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) == len(prompts)
    for rid in runs[0]:
        assert runs[0][rid][0] == runs[1][rid][0], rid
        assert runs[0][rid][1] == pytest.approx(runs[1][rid][1], abs=1e-3), rid


def test_steps_wider_than_the_largest_size_run_eagerly():
    """A 200-token prompt's step is wider than the largest size (96): it runs eagerly; the
    other prompts' steps run the pieces (counted by a wrapper around ``run``)."""
    engine = _engine(True)
    mixed, calls = engine.runner.mixed, []
    run = mixed.run

    def counting(step, prev=None):
        calls.append(len(step.ids))
        return run(step, prev)
    mixed.run = counting
    prompts = random_prompts([20, 200, 30], seed=5)
    reference = staggered(_engine(False), prompts)
    assert _tokens(staggered(engine, prompts)) == _tokens(reference)
    assert calls and max(calls) <= 96  # the prompts of 20 and 30 tokens, beside decoding


def _tokens(run: dict) -> dict:
    return {rid: rec[0] for rid, rec in run.items()}


def test_prompt_logprobs_through_the_piecewise_path():
    prompts = random_prompts([25, 40], seed=6)
    runs = [staggered(_engine(pw), prompts, prompt_logprobs=2) for pw in (True, False)]
    for rid in runs[1]:
        ours, ref = runs[0][rid][2], runs[1][rid][2]
        assert ref is not None and len(ours) == len(ref)
        for a, b in zip(ours, ref):
            if b is None:
                assert a is None
                continue
            assert a[0] == pytest.approx(b[0], abs=1e-3)
            assert [i for i, _ in a[1]] == [i for i, _ in b[1]]


def test_an_eager_step_plans_its_attention_after_layer_0s_queries():
    """An eager step (no pieces) queues the embedding and layer 0 up to its queries before the
    host plans the step's attention, as a piecewise step plans after piece 0; the tokens are the
    same as the forward planned up front."""
    engine = _engine(False)
    runner, order = engine.runner, []

    def noted(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: order.append(label) or fn(*a, **k))
    for i, layer in enumerate(engine.model.model.layers[:2]):
        noted(layer.self_attn, "queries", f"queries {i}")
        noted(layer.self_attn, "attend", f"attend {i}")
    noted(runner.backend, "plan", "plan")
    prompts = random_prompts([40], seed=9)
    got = _tokens(staggered(engine, prompts))
    assert order[:4] == ["queries 0", "plan", "attend 0", "queries 1"]
    upfront = _engine(False)
    forward = upfront.runner.model.forward
    upfront.runner.model.forward = lambda ids, pos, plan=None: (plan(), forward(ids, pos))[1]
    assert got == _tokens(staggered(upfront, prompts))


def _counting_prompt_steps(engine: LLMEngine) -> list[tuple[int, int]]:
    """(tokens, size) of each step the engine's lone-prompt path takes, as it takes it."""
    mixed, calls = engine.runner.mixed, []
    run_prompt = mixed.run_prompt

    def counting(step, size):
        calls.append((len(step.ids), size))
        return run_prompt(step, size)
    mixed.run_prompt = counting
    return calls


@pytest.mark.parametrize("budget", [8192, 40], ids=["whole-prompts", "chunked"])
def test_a_lone_prompts_whole_step_gives_the_eager_tokens(budget):
    """A prompt alone in its step with nothing cached before it takes the whole-step path
    (attention over every padded row, as its graph does on the GPU), over a cache filled with
    random values first, so that a real row reading a padding row's key, a page past the
    prompt's own or a stale slot would change its tokens; one prompt at a time, then staggered
    (prompts joining decoding sequences, and one behind a cached prefix, take the pieces); a
    chunked prompt's first chunk is a lone prompt, its next ones are not. The same greedy
    tokens and logprobs as the eager engine, and the pieces alone."""
    shared = random_prompts([48], seed=3)[0]
    prompts = random_prompts([30, 5, 70, 17, 90, 9], seed=4)
    prompts += [shared + [11, 12], shared + [13]]  # the second one hits the first's blocks
    kw = dict(max_num_batched_tokens=budget)
    engine = _engine(True, prompt_max=96, **kw)
    engine.runner.kv_storage.normal_(0, 4)
    calls = _counting_prompt_steps(engine)
    alone = staggered(engine, prompts, every=100)  # each prompt done before the next comes
    first = len(calls)
    fresh = random_prompts([26, 40, 23, 61], seed=8)
    mixed = staggered(engine, fresh)
    refs = [staggered(_engine(pw, **kw), prompts, every=100) for pw in (True, False)]
    for ref in refs:
        for rid, rec in ref.items():
            assert alone[rid][0] == rec[0], rid
            assert alone[rid][1] == pytest.approx(rec[1], abs=1e-3), rid
    assert _tokens(mixed) == _tokens(staggered(_engine(False, **kw), fresh))
    # alone: every prompt but the cached prefix's second, or (chunked) the first chunk of each
    assert [n for n, _ in calls[:first]] == (
        [30, 5, 70, 17, 90, 9, 50] if budget > 100 else [30, 5, 40, 17, 40, 9, 40])
    sizes = engine.runner.mixed.prompt_sizes
    assert all(size == min(s for s in sizes if s >= n) for n, size in calls)
    assert calls[first][0] == 26  # staggered: the first came alone, the others beside decoding


def test_a_prompt_beyond_the_largest_lone_prompt_size_takes_the_pieces():
    engine = _engine(True, prompt_max=48)
    calls = _counting_prompt_steps(engine)
    prompts = random_prompts([40, 60], seed=12)
    assert _tokens(staggered(engine, prompts, every=100)) == \
        _tokens(staggered(_engine(False), prompts, every=100))
    assert [n for n, _ in calls] == [40]


def test_lone_prompts_beyond_the_pieces_largest_size_take_their_own_graphs():
    """Lone-prompt graphs up to 160 tokens over pieces up to 48: a 100-token prompt alone takes
    its whole-step path (padded to 112), a 200-token one runs eagerly; the eager tokens."""
    engine = _engine(False)
    runner = engine.runner
    runner.mixed = MixedGraphs(runner, 48, capture=False, prompt_max_tokens=160)
    assert runner.mixed.max_tokens == 48 and runner.mixed.prompt_sizes[-1] == 160
    calls = _counting_prompt_steps(engine)
    prompts = random_prompts([100, 200], seed=13)
    assert _tokens(staggered(engine, prompts, every=100)) == \
        _tokens(staggered(_engine(False), prompts, every=100))
    assert calls == [(100, 112)]
