"""On a GPU: a prefill process pushes KV into a decode engine over CUDA IPC and NIXL (VRAM):
byte-identical blocks and the same greedy tokens as a colocated engine."""

import pytest
import torch

from benchmarks.engine_peers import Peer, finish
from decode_worker.core import DecodeCore
from engine import LLM, EngineConfig, SamplingParams
from tests.models import random_prompts

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl"])
def test_gpu_hand_over(backend, dtype):
    config = EngineConfig(model="tiny", device="cuda", dtype=dtype, num_blocks=128)
    prompts = random_prompts([7, 16, 45, 300], vocab=512, seed=41)
    expected = [o.token_ids for o in LLM(**config.model_dump()).generate(prompts, GREEDY)]
    prefill = Peer("prefill", config, backend)
    decode = DecodeCore(config, backend)
    try:
        for prompt, tokens in zip(prompts, expected):
            dest = decode.begin(prompt, GREEDY)
            result, src_kv = prefill.call("prefill", prompt, GREEDY, dest, decode.info(), 0)
            first = decode.complete(result)
            assert torch.equal(src_kv.cuda(), decode.endpoint.kv_cache[:, list(dest.block_ids)])
            assert finish(decode.engine, first).token_ids == tokens
        assert decode.held_blocks == 0 and decode.engine.pool.num_used_blocks == 0
    finally:
        prefill.stop()
        decode.close()
