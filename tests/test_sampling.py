"""Sampler behaviour and stop conditions, through the offline API."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence
from tests.models import random_prompts

PROMPTS = random_prompts([4, 12, 30], vocab=512, seed=5)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def _tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_same_seed_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _tokens(llm, PROMPTS[:1], params)[0]
    in_batch = _tokens(llm, PROMPTS, [params] + [SamplingParams(temperature=0.8, max_tokens=30)] * 2)
    assert in_batch[0] == alone
    other_seed = _tokens(llm, PROMPTS[:1], params.model_copy(update={"seed": 99}))[0]
    assert other_seed != alone


def test_seeded_request_resumed_from_its_tokens_continues_the_same(llm):
    """Draws are keyed by (seed, position): a request restarted with its prompt plus the tokens
    it had made (as after a replica's death) goes on with the very same tokens."""
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=24, ignore_eos=True)
    whole = _tokens(llm, PROMPTS[1:2], params)[0]
    for cut in (1, 9, 23):
        rest = _tokens(llm, [PROMPTS[1] + whole[:cut]],
                       params.model_copy(update={"max_tokens": 24 - cut}))[0]
        assert rest == whole[cut:], cut


def test_position_seeds_differ_by_seed_and_position():
    from engine.sampler import position_seed
    seeds = {position_seed(s, p) for s in (0, 1, 2**40, -3) for p in range(50)}
    assert len(seeds) == 200 and all(0 <= x < 2**64 for x in seeds)


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True)
    runs = {tuple(_tokens(llm, PROMPTS[:1], params)[0]) for _ in range(3)}
    assert len(runs) > 1


def test_top_k_one_equals_greedy(llm):
    greedy = _tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    top1 = _tokens(llm, PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=16,
                                                ignore_eos=True))
    assert top1 == greedy


def test_tiny_top_p_equals_greedy(llm):
    greedy = _tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert _tokens(llm, PROMPTS, SamplingParams(top_p=1e-6, max_tokens=16,
                                                ignore_eos=True)) == greedy


def test_top_k_and_top_p_keep_only_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 200)
    s = Sampler(torch.device("cpu"), seed=0)
    tokens = s(logits, _rows(SamplingParams(top_k=2), 200)).tokens
    assert set(tokens.tolist()) == {0, 1}
    # softmax([4,3,2,1,0]) ≈ [.64, .23, .09, .03, .01]: top_p=0.8 keeps the first two.
    tokens = s(logits, _rows(SamplingParams(top_p=0.8), 200)).tokens
    assert set(tokens.tolist()) == {0, 1}
    # min_p=0.3 keeps tokens at least 0.3 × the top probability: the first two (.23/.64 > .3).
    tokens = s(logits, _rows(SamplingParams(min_p=0.3), 200)).tokens
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_and_top_p_keep_ties_together():
    """The sampler's cut is :func:`kernels.argmax.cut_reference`'s, which a decode graph's draw
    follows: every token tied with the k-th stays; a tie group stays or goes whole under top-p;
    ranking only as deep as the largest top-k (every top-p row has one) keeps what ranking the
    whole vocabulary keeps. bfloat16-rounded logits tie often."""
    from engine.sampler import _apply_top_k_top_p
    from kernels.argmax import cut_reference
    # [3, 2, 2, 2, 0]: top_k=2 keeps the three 2s; softmax ~ [.46, .17, .17, .17, .02]: top_p
    # 0.5 keeps the 3 and all the 2s (the 3 holds less than 0.5), 0.4 only the 3
    row = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])
    for k, p, kept in ((2, 1.0, 4), (-1, 0.5, 4), (-1, 0.4, 1), (2, 0.39, 1)):
        cut = _apply_top_k_top_p(row, [k], [p])[0] > float("-inf")
        assert cut.sum() == kept and cut[0] and torch.equal(cut, cut_reference(row[0], k, p))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3000, generator=g) * 3).to(torch.bfloat16).float()
    x[0, :100] = float("-inf")
    ks = torch.randint(-1, 60, (64,), generator=g).tolist()
    ps = [1.0 if i % 3 == 0 else p for i, p in enumerate(torch.rand(64, generator=g).tolist())]
    some = [k if p < 1 else -1 for k, p in zip([k if k > 0 else 20 for k in ks], ps)]
    for top_k, top_p in ((ks, ps), ([k if k > 0 else 20 for k in ks], ps), (ks, [1.0] * 64),
                         ([-1] * 64, ps), (some, ps)):  # (some: rows of neither beside)
        out = _apply_top_k_top_p(x, top_k, top_p)
        for r in range(64):
            want = cut_reference(x[r], top_k[r], top_p[r]) & (x[r] > float("-inf"))
            assert torch.equal(out[r] > float("-inf"), want), (r, top_k[r], top_p[r])


def test_unseeded_rows_are_drawn_in_one_launch_at_the_cut_distribution():
    """Rows at a temperature, cut or not to a top-k of at most ``TOP_K_MAX`` and a top-p, and
    no seed or min-p are drawn by :class:`kernels.argmax.RowArgmax` (a decode graph's draw,
    keyed by the sequence's salt and its input token's position), greedy rows beside them
    taking the argmax; at the frequencies of the cut distribution. A seeded row among them
    keeps its own generator's draws."""
    from kernels.argmax import TOP_K_MAX, cut_reference, draw_reference
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0, -1.0]] * 3000)
    s = Sampler(torch.device("cpu"), seed=0)
    for params in (SamplingParams(temperature=0.7), SamplingParams(top_k=3, top_p=0.8),
                   SamplingParams(temperature=1.5, top_k=TOP_K_MAX)):
        rows = _rows(params, 3000, prompt=(1, 2))
        draws = [s.draw_of(r) for r in rows]
        assert None not in draws and len({d.salt for d in draws}) == 3000
        tokens = s(logits, rows).tokens
        inv_temp, salt, top_k, top_p = (torch.tensor(f) for f in zip(*draws))
        at = torch.ones(3000, dtype=torch.int64)  # the prompt's last token's position
        assert torch.equal(tokens, draw_reference(logits, inv_temp, salt, at, top_k, top_p))
        z = logits[0] / params.temperature
        p = torch.softmax(z.masked_fill(~cut_reference(z, params.top_k, params.top_p),
                                        float("-inf")), -1)
        freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
        assert (freq - p).abs().max() < 0.03, (params, freq, p)
    seeded = SamplingParams(top_k=3, seed=7)
    mixed = _rows(SamplingParams(temperature=0), 1) + _rows(seeded, 1)
    assert s.draw_of(mixed[1]) is None and s.draw_of(mixed[0]).inv_temp == 0
    alone = _rows(seeded, 1)
    for row in (alone[0], mixed[1]):
        row.generator = s.new_generator()  # (as the engine gives a seeded request)
    assert s(logits[:2], mixed).tokens.tolist() == [0, s(logits[:1], alone).tokens.item()]


def _rows(params, n, prompt=(1,)):
    return [Sequence(f"r{i}", list(prompt), params) for i in range(n)]


def test_max_tokens(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    full = _tokens(llm, PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True))[0]
    stop_id = full[5]
    first = full.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                  stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_string_cut_from_text(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop=[stop, "zzzz-never"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)


def test_eos_stops_unless_ignored(llm):
    engine = llm.engine
    full = _tokens(llm, PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True))[0]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({full[4]})  # pretend that token is the model's eos
    try:
        stopped = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20))[0]
        ignored = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == full[: full.index(full[4]) + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.token_ids == full and ignored.finish_reason == "length"


def test_logprobs_are_log_probabilities(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=True,
                                                  ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    assert all(lp <= 0 for lp in out.logprobs)


def test_per_prompt_params(llm):
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3, ignore_eos=True),
                                      SamplingParams(max_tokens=5, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
