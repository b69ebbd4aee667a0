"""The host-memory KV tier on a GPU (``make test-gpu``): copies each way run on a side stream
while steps run on the main one, so a step that overwrites blocks still being copied out, or
reads blocks still being copied in, would compute on the wrong KV. The CPU tests cannot see
that (a CPU copy is done when it is queued); here the same sequence must give the tokens of an
engine without the tier, bit for bit."""

import pytest

from engine import LLM
from tests.test_kv_offload import returning_after_evictions

pytestmark = pytest.mark.gpu
VOCAB = 151936
# Qwen3-0.6B: 28 layers x (K, V) x 8 KV heads x 128 x 2 bytes, 16 tokens a block
BLOCK_BYTES = 28 * 2 * 8 * 128 * 2 * 16


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_blocks_the_tier_dropped_are_copied_out_before_the_step_that_overwrites_them(kv):
    """Each prompt is 40 blocks (645 tokens); the eviction copies out of the sixth prompt's
    blocks (8 x 1.75 MiB) are queued on the copy stream with the new prompt's prefill, which
    writes those blocks, behind them on the main stream."""
    def make_llm(**kw):
        return LLM("dummy:Qwen3-0.6B", device="cuda", dtype="bfloat16", seed=0,
                   attention_backend="flashinfer", kv_cache_dtype=kv, show_progress=False, **kw)

    engine = returning_after_evictions(make_llm, 40, BLOCK_BYTES // (2 if kv == "fp8" else 1),
                                       VOCAB)
    assert engine.runner.graphs is not None  # the steps ran as they serve: graphed, ahead
