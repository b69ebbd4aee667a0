"""Tensor parallelism on CPU (gloo, worker processes): the greedy tokens of a model split over 2
or 4 ranks are those of one rank, float32, with prefix-cache hits, chunked prefill, preemption
and prompt logprobs; a size that does not divide the heads is refused before any rank starts."""

import pytest

from engine import LLM, SamplingParams
from tests.models import model_path, random_prompts

pytestmark = pytest.mark.slow  # worker processes: not the inner loop's tier
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name,size", [("tiny", 2), ("kv8-untied", 4)])
def test_split_model_gives_the_tokens_of_one_rank(name, size):
    """``tiny`` (tied embedding: the LM head is the vocabulary-parallel embedding) over 2 ranks;
    a model with Qwen3's 8 KV heads and its own LM head over 4."""
    path = str(model_path(name))
    vocab = 512 if name == "tiny" else 256
    prompts = random_prompts([5, 16, 33, 40, 70], vocab=vocab, seed=3)
    params = GREEDY.model_copy(update={"logprobs": 2, "prompt_logprobs": 1})
    one = LLM(path, show_progress=False)
    want = one.generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=size, show_progress=False)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert [p[0] for p in g.prompt_logprobs[1:]] == pytest.approx(
                [p[0] for p in w.prompt_logprobs[1:]], abs=1e-4)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix-cache hits now
        assert [o.token_ids for o in again] == _tokens(one, prompts)
        assert llm.engine.pool.hit_tokens > 0
        assert llm.engine.pool.num_used_blocks == 0
    finally:
        llm.engine.shutdown()


def test_chunked_prefill_and_preemption_over_two_ranks():
    path = str(model_path("tiny"))
    prompts = random_prompts([5, 16, 33, 40, 70], vocab=512, seed=3)
    want = _tokens(LLM(path, show_progress=False), prompts)
    llm = LLM(path, tensor_parallel_size=2, num_blocks=13, max_num_batched_tokens=16,
              show_progress=False)
    try:
        assert _tokens(llm, prompts) == want
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_a_size_that_does_not_divide_the_heads_is_refused_at_once():
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the "
                                         "model's attention heads"):
        LLM(str(model_path("tiny")), tensor_parallel_size=3, show_progress=False)


BLOCK_DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128)


@pytest.mark.parametrize("fmt", ["qwen-block", "compressed-tensors"])
def test_fp8_checkpoints_split_their_scales_with_their_weights(tmp_path, fmt):
    """An FP8 checkpoint over 2 ranks gives the tokens of one rank: each rank reads its rows
    (column-parallel) or columns (row-parallel) of the e4m3 weights and the matching part of
    their scales (per output channel, or 128x128 tiles), dequantized at load on CPU."""
    from tests.models import write_random_qwen3
    from tests.test_fp8 import COMPRESSED, QWEN_FP8, _blocks, fp8_checkpoint, representable
    from kernels.fp8 import quantize_per_channel

    dims = BLOCK_DIMS if fmt == "qwen-block" else DIMS_FP8
    plain = write_random_qwen3(tmp_path / "plain", dims, vocab_size=256,
                               tie_word_embeddings=False, initializer_range=0.2, seed=3)
    quantize, config = ((_blocks, QWEN_FP8) if fmt == "qwen-block"
                        else (quantize_per_channel, COMPRESSED))
    reference = representable(tmp_path / "ref", plain, quantize,
                              () if fmt == "qwen-block" else ("model.layers.1.mlp.down_proj",))
    ckpt = str(fp8_checkpoint(tmp_path / "fp8", reference, config))
    prompts = random_prompts([5, 16, 40], vocab=256, seed=3)
    want = _tokens(LLM(ckpt, show_progress=False), prompts)
    llm = LLM(ckpt, tensor_parallel_size=2, show_progress=False)
    try:
        assert llm.engine.weights_name.startswith("fp8")
        assert _tokens(llm, prompts) == want
    finally:
        llm.engine.shutdown()


DIMS_FP8 = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def test_fp8_tiles_a_rank_cannot_hold_whole_are_refused(tmp_path):
    from tests.models import write_random_qwen3
    from tests.test_fp8 import QWEN_FP8, _blocks, fp8_checkpoint, representable

    plain = write_random_qwen3(tmp_path / "plain", DIMS_FP8, vocab_size=256,
                               tie_word_embeddings=False, initializer_range=0.2, seed=3)
    ckpt = fp8_checkpoint(tmp_path / "fp8", representable(tmp_path / "ref", plain, _blocks),
                          QWEN_FP8)
    refusal = "not a multiple of its 128-wide FP8 scale tiles"
    with pytest.raises(ValueError, match=refusal) as failed:
        LLM(str(ckpt), tensor_parallel_size=2, show_progress=False)
    # The other rank stopped with the failed load, not when the engine is collected (the kept
    # traceback still holds it here, as a caller that logs or re-raises it would).
    import multiprocessing
    assert failed.traceback
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("baton-tp")]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_over_two_ranks(method):
    """Proposals verified over two ranks (a draft model on rank 0 only, whole): the greedy tokens
    of one rank without speculation."""
    path = str(model_path("tiny"))
    prompts = random_prompts([5, 16, 33], vocab=512, seed=3) + [[7, 8, 9] * 10]
    want = _tokens(LLM(path, show_progress=False), prompts)
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"model": path} if method == "draft_model" else {"prompt_lookup_max": 2,
                                                                 "prompt_lookup_min": 1})
    llm = LLM(path, tensor_parallel_size=2, speculative_config=spec, show_progress=False)
    from engine.spec_decode import SpecController  # held on: verify at every step it can
    llm.engine.spec = SpecController(min_acceptance=0.0, empty_steps=10**9, min_gain=None,
                                     start_on=True)
    try:
        assert _tokens(llm, prompts) == want
        stats = llm.engine.spec_stats  # verified over both ranks (an n-gram proposal may be
        # refused every time where bf16 continues the pattern otherwise: on a GPU, say)
        assert (stats.num_accepted_tokens if method == "draft_model"
                else stats.num_draft_tokens) > 0
    finally:
        llm.engine.shutdown()
