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
