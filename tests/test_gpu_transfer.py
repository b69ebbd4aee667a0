"""On a GPU: a prefill server in a child process pushes KV into a decode server over CUDA IPC and
NIXL (VRAM): byte-identical blocks and the same greedy tokens as a colocated engine."""

import asyncio

import pytest
import torch

from contracts import TokenSink
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from tests.models import random_prompts
from tests.roles import Peer, PeerPrefillHandle, capture_landed_kv, generate, until_idle

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _exact_hand_overs(config: EngineConfig, backend: str, prompts, warm: bool = False) -> None:
    """A prefill server in a child process pushes each prompt's KV into a decode server here
    (after warming its link first when ``warm``): byte-identical blocks, the colocated engine's
    tokens, both sides idle afterwards."""
    colocated = LLM(**config.model_dump())
    # One prompt at a time, as the decode server below runs them (in bf16 the batch size picks
    # the kernels, so a batch of four could round differently).
    expected = [colocated.generate([p], GREEDY)[0].token_ids for p in prompts]
    del colocated
    prefill = Peer("prefill", config, backend)
    handle = PeerPrefillHandle(prefill)
    decode = DecodeServer(config, backend, handle, disaggregation=ALWAYS)
    landed = capture_landed_kv(decode)

    async def main():
        sink = TokenSink()
        for i, (prompt, tokens) in enumerate(zip(prompts, expected)):
            got, result = await generate(decode, sink, prompt, f"r{i}", GREEDY)
            assert result.transfer is not None and result.transfer.backend == backend
            assert torch.equal(handle.pushed[f"r{i}"], landed[f"r{i}"])
            assert got == tokens
        await until_idle(decode)
        await sink.close()

    try:
        if warm:
            link = prefill.call("warm", decode.endpoint.info())
            assert (link["state"], link["backend"]) == ("warm", backend)
        asyncio.run(main())
        if warm:
            assert not decode.endpoint.ranks[0]._landed_early  # the warming's write was ignored
        assert prefill.call("gauges") == (0, 0)
    finally:
        prefill.stop()
        decode.close()


@pytest.mark.parametrize("model, dtype", [("tiny", "float32"), ("tiny", "bfloat16"),
                                          ("dummy:Qwen3-0.6B", "bfloat16")])
@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl"])
def test_gpu_hand_over(backend, model, dtype):
    """The 0.6B case runs FlashInfer, CUDA graphs and the one-row kernels in both engines."""
    config = EngineConfig(model=model, device="cuda", dtype=dtype, num_blocks=128,
                          max_num_seqs=8, show_progress=False)
    _exact_hand_overs(config, backend, random_prompts([7, 16, 45, 300], vocab=512, seed=41))


@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl"])
def test_gpu_link_warming_then_exact_hand_overs(backend):
    """A prefill server in a child process warms its link to this decode server (CUDA IPC maps
    the cache, NIXL loads the agent and writes one block); the hand-overs that follow move
    byte-identical KV and give the colocated tokens."""
    config = EngineConfig(model="tiny", device="cuda", dtype="float32", num_blocks=128,
                          max_num_seqs=8, show_progress=False)
    _exact_hand_overs(config, backend, random_prompts([16, 300], vocab=512, seed=43), warm=True)
