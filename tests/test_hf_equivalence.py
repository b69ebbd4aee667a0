"""Greedy tokens and logits identical to transformers' Qwen3ForCausalLM (float32, same weights)."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.models import RANDOM_CONFIGS, hf_greedy, model_path, random_prompts

MAX_NEW = 32
LENGTHS = [1, 7, 16, 23, 48, 61]  # partial blocks, exact multiples of the block size, one token


@pytest.fixture(scope="module", params=["tiny", *RANDOM_CONFIGS])
def case(request):
    path = model_path(request.param)
    vocab = 512 if request.param == "tiny" else 256
    prompts = random_prompts(LENGTHS, vocab=vocab, seed=len(request.param))
    hf, reference = hf_greedy(path, prompts, MAX_NEW)
    return path, prompts, hf, reference


def test_greedy_tokens_and_logprobs_match_transformers(case):
    path, prompts, _, reference = case
    llm = LLM(str(path), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=True)
    outputs = llm.generate(prompts, params)  # one batch, prompts of different lengths
    for out, (hf_tokens, hf_logits) in zip(outputs, reference):
        assert out.token_ids == hf_tokens
        hf_logprobs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(hf_tokens)[:, None])
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs[:, 0],
                                   atol=1e-4, rtol=1e-4)
    assert llm.engine.pool.num_used_blocks == 0


def test_prefill_logits_close_to_transformers(case):
    path, prompts, hf, _ = case
    llm = LLM(str(path), device="cpu")
    for p in prompts:
        llm.engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    batch = llm.engine.scheduler.schedule()
    logits = llm.engine.runner.execute(batch)
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [None, 16])  # one prefill chunk, or chunks of 16 tokens
def test_prompt_logprobs_match_transformers(case, budget):
    """``prompt_logprobs``: each prompt token's logprob given those before it and the top k
    there, as transformers' log-softmax of its logits gives them; computed whole even when the
    prompt is in the prefix cache, and across chunked prefill."""
    path, prompts, hf, _ = case
    kw = {"max_num_batched_tokens": budget} if budget else {}
    llm = LLM(str(path), device="cpu", **kw)
    llm.generate(prompts[4], SamplingParams(max_tokens=1))  # now a prefix-cache hit
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    for p, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
        for pos in range(1, len(p)):
            lp, top = out.prompt_logprobs[pos]
            assert lp == pytest.approx(logp[pos - 1, p[pos]].item(), abs=1e-4)
            want = logp[pos - 1].topk(3)
            assert [t for t, _ in top] == want.indices.tolist()
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert llm.engine.pool.num_used_blocks == 0
