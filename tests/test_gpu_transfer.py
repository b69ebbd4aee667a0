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


@pytest.mark.parametrize("model, dtype", [("tiny", "float32"), ("tiny", "bfloat16"),
                                          ("dummy:Qwen3-0.6B", "bfloat16")])
@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl"])
def test_gpu_hand_over(backend, model, dtype):
    """The 0.6B case runs FlashInfer, CUDA graphs and the one-row kernels in both engines."""
    config = EngineConfig(model=model, device="cuda", dtype=dtype, num_blocks=128,
                          max_num_seqs=8, show_progress=False)
    prompts = random_prompts([7, 16, 45, 300], vocab=512, seed=41)
    colocated = LLM(**config.model_dump())
    # One prompt at a time, as the decode engine below runs them (in bf16 the batch size picks
    # the kernels, so a batch of four could round differently).
    expected = [colocated.generate([p], GREEDY)[0].token_ids for p in prompts]
    del colocated
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
