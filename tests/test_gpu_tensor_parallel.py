"""Tensor parallelism on GPUs (a host with two or more: ``make test-gpu``): NCCL collectives,
also inside the captured decode graphs, and the hand-over between split caches on two GPUs.

The model is a small random checkpoint written to disk with Qwen3's head shapes (16 query and 8
KV heads of 128): ``dummy:`` weights are drawn per rank, so a split dummy model is another model.

- A model split over 2 GPUs gives the greedy tokens and logprobs of one GPU (float32, the torch
  attention backend: the split only reorders sums), with prefix-cache hits.
- bf16 on FlashInfer: the split engine's CUDA-graph decode gives its eager tokens; so does
  the split engine with FP8 weights and head (each rank quantizes its own shards).
- The hand-over between replicas of 1 and 2 ranks spread over both GPUs, over CUDA IPC
  (same-GPU copies, and pack / peer copy / unpack across them; a worker rank's cache offered by
  its own handle) and NIXL: the tokens of one rank colocated, every rank's heads of every block
  moved, nothing held afterwards on either side (which heads land where is checked exactly by
  the CPU tests, ``tests/test_tensor_parallel_handover.py``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.models import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two GPUs")]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VOCAB = 8192
PROMPTS = random_prompts([7, 40, 129, 300], vocab=VOCAB, seed=11)
FP32 = dict(device="cuda:0", dtype="float32", attention_backend="torch", num_blocks=512,
            max_num_seqs=8, show_progress=False, seed=0)
DIMS = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from engine.tiny import write_random_qwen3

    path = tmp_path_factory.mktemp("tp") / "qwen3-kv8"
    write_random_qwen3(path, DIMS, vocab_size=VOCAB, tie_word_embeddings=False,
                       initializer_range=0.05, seed=2)
    return str(path)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_split_over_two_gpus_gives_the_tokens_of_one(model):
    params = GREEDY.model_copy(update={"logprobs": 1})
    one = LLM(model, **FP32)
    want = one.generate(PROMPTS, params, use_tqdm=False)
    del one
    llm = LLM(model, tensor_parallel_size=2, **FP32)
    try:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)
        assert _tokens(llm, PROMPTS) == [o.token_ids for o in want]  # prefix-cache hits now
        assert llm.engine.pool.hit_tokens > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_split_cuda_graphs_give_the_eager_tokens(model, quantization):
    bf16 = dict(device="cuda:0", dtype="bfloat16", num_blocks=1024, max_num_seqs=16,
                show_progress=False, seed=0, tensor_parallel_size=2)
    if quantization:  # each rank's shards of the projections and of the head in e4m3
        bf16.update(quantization=quantization, fp8_lm_head=True)
    prompts = random_prompts([5, 17, 33, 64, 100, 130], vocab=VOCAB, seed=12)
    alone = random_prompts([9, 128, 300], vocab=VOCAB, seed=13)  # a lone prompt's graph each
    params = GREEDY.model_copy(update={"max_tokens": 32})
    eager = LLM(model, enforce_eager=True, **bf16)
    try:
        want = _tokens(eager, prompts, params)
        want_alone = [_tokens(eager, [p], params)[0] for p in alone]
    finally:
        eager.engine.shutdown()
    del eager
    graphed = LLM(model, **bf16)
    try:
        assert graphed.engine.runner.graphs is not None
        if quantization:  # (rank 0's model; the worker ranks load theirs by the same config)
            assert graphed.engine.weights_name.startswith("fp8")
            assert graphed.engine.model.lm_head_fp8 is not None
        assert _tokens(graphed, prompts, params) == want
        mixed, replayed = graphed.engine.runner.mixed, []
        run_prompt = mixed.run_prompt

        def counting(step, size):
            replayed.append(size in mixed.prompt_graphs)
            return run_prompt(step, size)
        mixed.run_prompt = counting
        assert [_tokens(graphed, [p], params)[0] for p in alone] == want_alone
        assert replayed == [True] * 3  # (rank 0's; the other rank takes the same path)
    finally:
        graphed.engine.shutdown()


PAIRS = [(1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def offline(model):
    one = LLM(model, **FP32)
    return [o.token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl"])
@pytest.mark.parametrize("p,d", PAIRS)
def test_split_caches_hand_over_across_gpus(model, offline, backend, p, d):
    """The prefill server runs in a child process, as a replica does (a process cannot open
    its own CUDA IPC handles); the decode server in this one."""
    from contracts import TokenSink
    from decode_worker.placement import ALWAYS
    from decode_worker.server import DecodeServer
    from tests.roles import Peer, PeerPrefillHandle, generate, until_idle

    prefill = Peer("prefill", EngineConfig(model=model, tensor_parallel_size=p, **FP32), backend)
    decode = None
    try:
        decode = DecodeServer(EngineConfig(model=model, tensor_parallel_size=d, **FP32), backend,
                              PeerPrefillHandle(prefill), 60.0, disaggregation=ALWAYS)
        devices = {r.device for r in (*prefill.info.rank_infos, *decode.endpoint.info().rank_infos)}
        assert devices == {"cuda:0", "cuda:1"}

        async def main():
            sink = TokenSink()
            for i, prompt in enumerate(PROMPTS):
                tokens, result = await generate(decode, sink, prompt, f"{p}{d}-{i}", GREEDY)
                assert tokens == offline[i]
                assert result.transfer is not None  # handed over, not prefilled here
                assert result.transfer.bytes == result.transfer.blocks_sent \
                    * decode.endpoint.layout.block_bytes * d  # every rank's heads of a block
            await until_idle(decode)
            await sink.close()

        asyncio.run(main())
        assert prefill.call("gauges") == (0, 0)  # no block leased or in use over there
    finally:
        prefill.stop()
        if decode is not None:
            decode.close()
