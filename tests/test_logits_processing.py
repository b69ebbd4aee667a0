"""Penalties, logit_bias, min_tokens, min_p, top logprobs and n / best_of in the engine, against a
reference written out step by step over transformers' logits for the same weights."""

from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import fan_out
from tests.models import model_path, random_prompts

MAX_NEW = 24
PROMPTS = random_prompts([5, 19, 40], vocab=512, seed=11)
EOS = 2  # what the test pretends the model's EOS is, where it matters


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(str(model_path("tiny")),
                                            dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    return LLM("tiny", async_scheduling=request.param)


def reference(hf, prompt: list[int], p: SamplingParams, eos: set[int] = frozenset()):
    """Greedy decoding with the changes written plainly, one token at a time: (tokens, raw
    logits of each step)."""
    out, raw = [], []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].clone()
        raw.append(logits.clone())
        for token, bias in p.logit_bias:
            logits[token] += bias
        if len(out) < p.min_tokens:
            for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
                logits[token] = float("-inf")
        for token in set(prompt + out):
            value = logits[token]
            logits[token] = value / p.repetition_penalty if value > 0 \
                else value * p.repetition_penalty
        for token, count in Counter(out).items():
            logits[token] -= p.frequency_penalty * count + p.presence_penalty
        token = int(logits.argmax())
        out.append(token)
        if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
            break
    return out, raw


CASES = {
    "plain": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    "repetition": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                 repetition_penalty=1.8),
    "frequency": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                frequency_penalty=1.5),
    "presence": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                               presence_penalty=-1.2),
    "all": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                          repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=0.9,
                          logit_bias={7: 3.0, 99: -100.0, 300: 1.5}),
    "bias": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                           logit_bias={41: 100.0}),
}


def test_changed_logits_give_the_reference_tokens(llm, hf):
    """One batch mixing every kind (and rows with nothing changed): each row equals the
    reference, so no row's change leaks into another."""
    prompts = [p for p in PROMPTS for _ in CASES]
    params = [c for _ in PROMPTS for c in CASES.values()]
    outs = llm.generate(prompts, params)
    for prompt, p, out, name in zip(prompts, params, outs, [*CASES] * len(PROMPTS)):
        assert out.token_ids == reference(hf, prompt, p)[0], (name, len(prompt))
    plain = [o.token_ids for o, n in zip(outs, [*CASES] * len(PROMPTS)) if n == "plain"]
    changed = [o.token_ids for o, n in zip(outs, [*CASES] * len(PROMPTS)) if n != "plain"]
    assert all(c not in plain for c in changed)  # each change did change something
    assert all(o.token_ids == [41] * MAX_NEW for o, n in zip(outs, [*CASES] * len(PROMPTS))
               if n == "bias")
    assert llm.engine.pool.num_used_blocks == 0


def test_min_tokens_holds_back_eos_and_stop_ids_then_lets_them_stop(llm, hf):
    engine = llm.engine
    prompt = PROMPTS[1]
    free = reference(hf, prompt, CASES["plain"])[0]
    stop_id = free[3]  # a token the unconstrained run makes early
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({stop_id})
    try:
        early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW))[0]
        held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                   min_tokens=10))[0]
        held_ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                       min_tokens=10, ignore_eos=True,
                                                       stop_token_ids=[stop_id]))[0]
    finally:
        engine.eos_token_ids = saved
    assert early.token_ids == free[:free.index(stop_id) + 1]
    expected = reference(hf, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    min_tokens=10), eos={stop_id})[0]
    assert held.token_ids == expected and len(expected) >= 10
    assert stop_id not in held.token_ids[:10]
    assert held_ids.token_ids == expected


def test_min_tokens_ignores_stop_strings_before_it(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = full.text[1:3]
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop=[stop]))[0]
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop=[stop], min_tokens=12))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 12
    assert len(late.token_ids) >= 12


def test_top_logprobs_are_those_of_the_raw_distribution(llm, hf):
    prompt = PROMPTS[2]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                       repetition_penalty=1.5)
    out = llm.generate(prompt, p)[0]
    tokens, raw = reference(hf, prompt, p)
    assert out.token_ids == tokens
    assert len(out.top_logprobs) == len(tokens) == len(out.logprobs)
    for logits, token, lp, top in zip(raw, tokens, out.logprobs, out.top_logprobs):
        expected = torch.log_softmax(logits, -1)
        values, ids = expected.topk(5)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4,
                                   rtol=1e-4)
        assert lp == pytest.approx(float(expected[token]), abs=1e-4)
    # logprobs=0: the sampled token's logprob, no alternatives.
    bare = llm.generate(prompt, p.model_copy(update={"logprobs": 0}))[0]
    assert bare.top_logprobs is None and bare.logprobs == pytest.approx(out.logprobs, abs=1e-5)


def test_a_resumed_request_continues_with_the_same_penalties(llm):
    """Migration resubmits prompt + tokens so far: with ``num_resumed_tokens`` those count as
    output, so frequency and presence penalties go on exactly as in one run."""
    p = SamplingParams(temperature=0.9, seed=5, max_tokens=MAX_NEW, ignore_eos=True,
                       frequency_penalty=1.0, presence_penalty=0.5)
    whole = llm.generate(PROMPTS[0], p)[0].token_ids
    cut = 9
    rest = llm.generate(PROMPTS[0] + whole[:cut], p.model_copy(update={
        "max_tokens": MAX_NEW - cut, "num_resumed_tokens": cut}))[0].token_ids
    assert rest == whole[cut:]


def test_n_sequences_equal_single_requests_and_share_the_prompt(llm):
    prompt = random_prompts([40], vocab=512, seed=77)[0]  # 2 full blocks + 8; not cached yet
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=6, ignore_eos=True, n=3)
    before = llm.engine.stats.scheduled_tokens
    outs = llm.generate(prompt, p)[0]
    scheduled = llm.engine.stats.scheduled_tokens - before
    singles = [llm.generate(prompt, p.model_copy(update={"n": 1, "seed": 123 + i}))[0].token_ids
               for i in range(3)]
    assert [o.token_ids for o in outs] == singles
    assert len({tuple(s) for s in singles}) > 1
    # One prefill of 40 tokens, then each other sequence computes only its partial last block
    # (8 tokens) from the prefix cache; plus 5 decode steps each.
    assert scheduled == 40 + 2 * 8 + 3 * 5


def test_best_of_returns_the_n_most_likely(llm):
    prompt = PROMPTS[0]
    p = SamplingParams(temperature=1.2, seed=9, max_tokens=6, ignore_eos=True, n=2, best_of=5)
    outs = llm.generate(prompt, p)[0]
    every = [llm.generate(prompt, c)[0] for c in fan_out(p)]
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert [o.token_ids for o in outs] == [c.token_ids for c in ranked[:2]]
    assert outs[0].cumulative_logprob >= outs[1].cumulative_logprob


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be positive"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("logprobs", 21, "logprobs must be in [0, 20]"),
    ("logit_bias", {5: 101}, "must be in [-100, 100]"),
    ("logit_bias", {"x": 1}, "keys must be token ids"),
    ("logit_bias", {-1: 1}, "is negative"),
    ("min_tokens", 17, "min_tokens must be in [0, max_tokens=16]"),
    ("n", 0, "n must be in [1, 128]"),
    ("best_of", 1, "best_of must be in [n=2"),
    ("repetition_penalty", float("nan"), "repetition_penalty"),
])
def test_bad_values_name_the_field(field, value, message):
    kwargs = {field: value}
    if field == "best_of":
        kwargs["n"] = 2
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="n/best_of"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(n=2))
    assert not llm.engine.has_unfinished_requests()
