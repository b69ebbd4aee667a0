"""On a GPU: every Qwen3 size starts with default settings and decodes (bf16, and FP8 weights
with an FP8 KV cache); the FP8 kernels against their float32 references at every row count the
engine uses; FP8 engines under CUDA graphs against eager, FlashInfer over an FP8 cache against
the torch backend, prefix hits; FP8 checkpoints in both formats against their dequantized bf16
reference; FP8 blocks through CUDA IPC and NIXL hand-overs."""

import gc

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from kernels import qk_norm_rope_store, qk_norm_rope_store_reference
from kernels.fp8 import (_TORCH_BLOCK_REFUSED, FP8, FP8_CHAIN_WINNERS, SKINNY_MAX_ROWS,
                         fp8_gemv_config, fp8_gemv_reference, fp8_linear, quantize_per_block,
                         quantize_per_channel, quantize_rows, quantize_rows_reference,
                         w8a8_reference)
from tests.models import random_prompts
from tests.test_gpu_engine import VOCAB, TwoBackends, _engine, _run
from tests.test_gpu_transfer import _exact_hand_overs

pytestmark = pytest.mark.gpu
SIZES = ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B"]


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size", SIZES)
def test_every_size_starts_and_decodes_with_default_settings(size, fp8):
    extra = dict(quantization="fp8", kv_cache_dtype="fp8") if fp8 else {}
    llm = LLM(f"dummy:{size}", max_model_len=512, show_progress=False, **extra)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.backend.name == "flashinfer"
    prompts = random_prompts([100, 7, 33], vocab=VOCAB, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    if fp8:
        assert llm.engine.weights_name == "fp8 (on-the-fly, channel)"
        assert runner.kv_cache.dtype == FP8
    del llm, runner
    _free()


# -- kernels ----------------------------------------------------------------------------------
def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 13, 16, 17, 24, 33, 64, 65, 100, 256])
@pytest.mark.parametrize("fmt, k", [("channel", 2560), ("block", 2560), ("block", 2176)])
def test_fp8_linear_matches_its_reference_at_every_row_count(rows, fmt, k):
    """K = 2176 (17 scale columns) takes the fallback kernels in the block format."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    n = 1024 + 256
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
    block = (128, 128) if fmt == "block" else None
    q, s = quantize_per_block(w, block) if block else quantize_per_channel(w)
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    out[:] = fp8_linear(x, q, s, block, fp8_gemv_config(n, k))
    # bf16 activations (one row; a few rows of the channel format; block rows cuBLASLt refused)
    # or W8A8 with dynamic activation scales (the rest)
    bf16_activations = rows == 1 or (rows <= SKINNY_MAX_ROWS and (
        block is None or rows in _TORCH_BLOCK_REFUSED or k % 512))
    ref = (fp8_gemv_reference(x, q, s, block) if bf16_activations
           else w8a8_reference(x, q, s, block))
    assert not out.isnan().any()
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("nk", sorted(FP8_CHAIN_WINNERS))
def test_the_one_row_fp8_chain_winners_match_the_reference(nk, fmt):
    """The one-row FP8 kernel at each shape's own tiles (Qwen3-32B's and 0.6B's projections, as
    ``fp8_gemv_config`` gives them), both weight formats: against the float32 reference."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    block = (128, 128) if fmt == "block" else None
    q, s = quantize_per_block(w, block) if block else quantize_per_channel(w)
    out = fp8_linear(x, q, s, block, fp8_gemv_config(n, k))
    assert _rel(out, fp8_gemv_reference(x, q, s, block)) < 1e-2


@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_the_few_row_kernel_split_over_k_matches_its_reference_and_replays(rows, fmt):
    """K split in 1, 2 and 4 ranges (the last program of a tile to arrive adds the partials):
    each against the float32 reference; eager and replayed in a CUDA graph on new inputs give
    the same bytes (the sums in split order whoever arrives last; the counters back at zero
    after every launch)."""
    from kernels.fp8 import _COUNTERS, fp8_skinny_mm, skinny_split

    assert [skinny_split(*nk) for nk in [(6144, 4096), (4096, 4096), (24576, 4096),
                                         (4096, 12288), (5120, 25600), (1280, 2176)]] == [
        2, 4, 1, 4, 4, 1]
    g = torch.Generator(device="cuda").manual_seed(rows)
    n = 1280 + 32
    block = (128, 128) if fmt == "block" else None
    for k, splits in [(4096, (1, 2, 4)), (4096 + 64, (1,))]:  # the latter: a masked K tail
        q, s = (quantize_per_block if block else quantize_per_channel)(
            torch.randn(n, k, device="cuda", generator=g) * 0.02, *([block] if block else []))
        xs = [torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(3)]
        for split in splits:
            eager = [fp8_skinny_mm(x, q, s, block, split=split) for x in xs]
            for x, out in zip(xs, eager):
                assert _rel(out, fp8_gemv_reference(x, q, s, block)) < 1e-2
            static = xs[0].clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fp8_skinny_mm(static, q, s, block, split=split)
            for x, ref in zip(xs, eager):
                static.copy_(x)
                graph.replay()
                assert torch.equal(out, ref)
            torch.cuda.synchronize()
            assert not _COUNTERS[torch.device("cuda", torch.cuda.current_device())].any()


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_matches_reference(group):
    x = torch.randn(37, 4096 + 128, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_rows(x, group)
    qr, sr = quantize_rows_reference(x, group)
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    # the same e4m3 values but for ties rounded the other way
    assert (q.float() != qr.float()).float().mean() < 1e-3


@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("width", [1024, 3000, 4096, 12288, 20000])
def test_norm_and_silu_quantizing_their_output_match_the_kernels_they_replace(rows, width):
    """rmsnorm_quant = rmsnorm then quantize_rows, silu_and_mul_quant = silu_and_mul then
    quantize_rows: the same e4m3 bytes and scales (each rounds the bf16 activation first)."""
    from kernels import rmsnorm, silu_and_mul
    from kernels.activation import silu_and_mul_quant
    from kernels.norm import rmsnorm_quant

    g = torch.Generator(device="cuda").manual_seed(rows * width)
    x = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16) * 3
    res = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.rand(width, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    for residual in (res, None):
        q, s, new_res = rmsnorm_quant(x, w, 1e-6, residual)
        out = rmsnorm(x, w, 1e-6, residual)
        normed, expected = out if residual is not None else (out, x)
        rq, rs = quantize_rows(normed)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        assert torch.equal(new_res, expected)
    gate_up = torch.randn(rows, 2 * width, device="cuda", generator=g).to(torch.bfloat16) * 4
    q, s = silu_and_mul_quant(gate_up)
    rq, rs = quantize_rows(silu_and_mul(gate_up))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("tile", [None, (1, 1)], ids=["tiles", "a-token-a-program"])
def test_rope_store_into_an_fp8_cache_matches_reference(tile):
    t, hq, hk, d = 9, 4, 2, 128  # (tiles of 8 tokens: one full, one of a token)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda") + 5
    qw, kw = (torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    from engine.models.layers import RotaryEmbedding
    rope = RotaryEmbedding(d, 64, 1e6)
    rope.build(torch.device("cuda"))
    caches = [torch.zeros(4, 2, hk, 16, d, device="cuda", dtype=FP8) for _ in range(2)]
    slots = torch.tensor([17, 18, -1, 20, 21, 22, 23, 24, 40], device="cuda")
    q = qk_norm_rope_store(qkv, pos, qw, kw, 1e-6, rope.cos_sin, caches[0], slots, hq, hk,
                           0.5, 2.0, tile=tile)
    qr = qk_norm_rope_store_reference(qkv, pos, qw, kw, 1e-6, rope.cos_sin, caches[1], slots,
                                      hq, hk, 0.5, 2.0)
    torch.testing.assert_close(q, qr, rtol=2e-2, atol=2e-2)  # fused: rounds once, not per op
    diff = (caches[0].float() - caches[1].float()).abs()
    assert (diff > 0).float().mean() < 0.02  # one e4m3 step where rounding ties differ


# -- engines ----------------------------------------------------------------------------------
FP8_ENGINE = dict(quantization="fp8", kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def fp8_engine():
    _free()
    return _engine(attention_backend="flashinfer", **FP8_ENGINE)


@pytest.mark.parametrize("tensor_cores, batches", [(False, (1, 3, 8, 20)), (True, (1, 8, 16, 24))],
                         ids=["cuda-cores", "tensor-cores"])
def test_fp8_cuda_graphs_match_eager_tokens(tensor_cores, batches):
    """Exact tokens. On tensor cores (the default over an FP8 cache, and for Qwen3-14B/32B in
    bf16) FlashInfer splits the KV by the batch it was planned for, so a batch that replays a
    larger graph (20 rows in the 24-row graph) sums in another order than eager; random weights
    turn that rounding into other tokens after a few steps (seen for bf16 too), so the
    tensor-core case runs batches that are graph sizes."""
    kw = dict(attention_backend="flashinfer", decode_tensor_cores=tensor_cores, **FP8_ENGINE)
    graphs, eager = _engine(**kw), _engine(enforce_eager=True, **kw)
    for n in batches:
        prompts = random_prompts([20 + 11 * i for i in range(n)], vocab=VOCAB, seed=n)
        assert _run(graphs, prompts, 24, prefix=f"g{n}-") == _run(eager, prompts, 24,
                                                                  prefix=f"g{n}-")


def test_fp8_prefill_of_up_to_2048_tokens_replays_the_piecewise_graphs():
    """FP8 weights take steps of up to 2,048 tokens on the piecewise graphs by default (their
    eager steps are bound by the host): prompts of 600, 1,100 (padded to 1,152) and 2,000
    tokens joining a decoding batch give the eager engine's greedy tokens and logprobs, up to a
    near-tie (as for bf16 in tests/test_gpu_engine.py)."""
    from tests.test_gpu_engine import _same_greedy_up_to_a_tie
    from tests.test_mixed_graphs import staggered

    kw = dict(attention_backend="flashinfer", **FP8_ENGINE)
    prompts = random_prompts([30, 600, 9, 1100, 2000, 17], vocab=VOCAB, seed=31)
    graphs = _engine(**kw)
    mixed = graphs.runner.mixed
    assert mixed is not None and mixed.max_tokens == 2048
    calls, run = [], mixed.run

    def counting(step, prev=None):
        calls.append(len(step.ids))
        return run(step, prev)
    mixed.run = counting
    graphed = staggered(graphs, prompts, max_tokens=16)
    del graphs, mixed
    _free()
    assert max(calls) > 2000
    eager = staggered(_engine(enforce_eager=True, **kw), prompts, max_tokens=16)
    assert graphed.keys() == eager.keys()
    for rid, (tokens, logprobs, _) in eager.items():
        _same_greedy_up_to_a_tie(graphed[rid][0], graphed[rid][1], tokens, logprobs, rid)


@pytest.mark.parametrize("quantization", ["fp8", None], ids=["fp8", "bf16-weights"])
def test_fp8_lm_head_graphs_match_eager_and_stay_near_the_bf16_head(quantization):
    """``fp8_lm_head``: logits from the e4m3 head through the one-row kernel (batch 1) and W8A8
    (more rows): CUDA graphs give eager's tokens, and the next-token distribution stays near the
    bf16 head's (mean KL under 0.05 on this random model, whose distribution is nearly flat).
    With FP8 weights and with bf16 ones (the head alone in FP8)."""
    kw = dict(attention_backend="flashinfer", quantization=quantization)
    graphs, eager = _engine(fp8_lm_head=True, **kw), _engine(fp8_lm_head=True,
                                                               enforce_eager=True, **kw)
    assert graphs.model.lm_head_fp8 is not None
    for n in (1, 8, 20):
        prompts = random_prompts([20 + 11 * i for i in range(n)], vocab=VOCAB, seed=40 + n)
        assert _run(graphs, prompts, 16, prefix=f"h{n}-") == _run(eager, prompts, 16,
                                                                  prefix=f"h{n}-")
    hidden = torch.randn(64, graphs.model.config.hidden_size, device="cuda",
                         dtype=torch.bfloat16)
    fp8 = torch.log_softmax(graphs.model.compute_logits(hidden), -1)
    head, graphs.model.lm_head_fp8 = graphs.model.lm_head_fp8, None
    bf16 = torch.log_softmax(graphs.model.compute_logits(hidden), -1)
    graphs.model.lm_head_fp8 = head
    assert (bf16.exp() * (bf16 - fp8)).sum(-1).mean().item() < 0.05


def test_a_bf16_engine_with_the_fp8_head_starts_in_a_fresh_process():
    """With bf16 weights the head is the engine's only FP8 matmul, so its few-row and W8A8
    kernels first run at the decode graphs' capture: each graph's logits now run eagerly once
    before it is captured. (It failed at capture in a process with no FP8 engine before it.)"""
    import subprocess
    import sys

    from tests.test_gpu_engine import MODEL

    code = ("from engine import EngineConfig\nfrom engine.llm_engine import LLMEngine\n"
            f"e = LLMEngine(EngineConfig(model={MODEL!r}, device='cuda', dtype='bfloat16', "
            "num_blocks=256, max_num_seqs=8, show_progress=False, fp8_lm_head=True))\n"
            "assert e.model.lm_head_fp8 is not None and e.runner.graphs.graphs\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
def test_one_row_gate_up_ending_in_the_silu_gives_the_tokens_of_the_silu_kernel(
        quantization, monkeypatch):
    """Qwen3-1.7B (intermediate 6,144: wider than the down projection's own fold, hidden 2,048:
    no norm folded into the gate/up): its one-row gate/up projection ends in the
    SiLU-and-multiply (``kernels.gemv.GLU_EPILOGUE``). Batch-1 greedy tokens and logprobs,
    graphed and eager, are exactly those of the same engine running the SiLU kernel."""
    import engine.models.qwen3 as qwen3
    from tests.test_mixed_graphs import staggered

    kw = dict(model="dummy:Qwen3-1.7B", attention_backend="flashinfer", num_blocks=512,
              quantization=quantization)
    prompts = random_prompts([20, 57], vocab=VOCAB, seed=5)
    runs = {}
    for glu in (True, False):
        monkeypatch.setattr(qwen3, "GLU_EPILOGUE", glu)
        for eager in (False, True):
            engine = _engine(enforce_eager=eager, **kw)
            assert engine.model.model.layers[0].mlp.glu_in_projection(1) == glu
            assert not engine.model.model.layers[0].mlp.glu_in_projection(2)
            runs[glu, eager] = staggered(engine, prompts, max_tokens=24, every=40)  # batch 1
            del engine
            _free()
    for eager in (False, True):
        assert runs[True, eager] == runs[False, eager], f"eager={eager}"


@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "logits"])
def test_flashinfer_over_an_fp8_cache_matches_torch(fp8_engine, per_layer):
    both = TwoBackends(fp8_engine, per_layer)
    base = random_prompts([80, 150], vocab=VOCAB, seed=7)
    try:
        _run(fp8_engine, base, 6, prefix=f"kv{per_layer}")
        _run(fp8_engine, [p + [5, 6, 7] for p in base], 4, prefix=f"kvhit{per_layer}")
    finally:
        both.restore()
    both.check()


def _prefill_logits(engine, prompts):
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule()).float().clone()
    while engine.has_unfinished_requests():
        engine.step()
    return logits


def test_fp8_prefix_hit_reads_back_what_the_miss_wrote(fp8_engine):
    """The second run of a prompt reads its first 288 tokens' KV from the FP8 cache; its
    next-token logits agree with the first run's (which attended to the same FP8 values). Not
    to rounding: the miss computes 300 rows (W8A8 GEMMs, activations in e4m3), the hit 12
    (bf16 activations), which moves this random model's logits by ~5%."""
    prompt = random_prompts([300], vocab=VOCAB, seed=11)
    miss = _prefill_logits(fp8_engine, prompt)
    hits = fp8_engine.pool.hit_tokens
    hit = _prefill_logits(fp8_engine, prompt)
    assert fp8_engine.pool.hit_tokens >= hits + 288
    assert _rel(hit, miss) < 8e-2
    assert hit.argmax(-1).tolist() == miss.argmax(-1).tolist()


# -- checkpoint formats on the FP8 kernels ----------------------------------------------------
@pytest.mark.parametrize("fmt", ["qwen", "compressed"])
def test_fp8_checkpoints_run_natively_close_to_their_dequantized_reference(fmt, tmp_path):
    from tests.test_fp8 import (COMPRESSED, QWEN_FP8, _blocks, fp8_checkpoint, representable)
    from engine.tiny import write_random_qwen3
    dims = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=1, head_dim=128)
    plain = write_random_qwen3(tmp_path / "plain", dims, vocab_size=1024,
                               tie_word_embeddings=False, initializer_range=0.05, seed=3)
    quantize, config = ((_blocks, QWEN_FP8) if fmt == "qwen"
                        else (quantize_per_channel, COMPRESSED))
    keep = ("model.layers.1.mlp.down_proj",) if fmt == "compressed" else ()
    reference = representable(tmp_path / "ref", plain, quantize, keep)
    ckpt = fp8_checkpoint(tmp_path / "fp8", reference, config)
    prompts = random_prompts([5, 40, 130], vocab=1024, seed=2)
    got = LLM(str(ckpt), dtype="bfloat16", show_progress=False).engine
    layers = got.model.model.layers
    assert layers[0].mlp.down_proj.weight.dtype == FP8
    assert layers[1].mlp.down_proj.weight.dtype == (torch.bfloat16 if keep else FP8)
    want = LLM(str(reference), dtype="bfloat16", show_progress=False).engine
    # W8A8 against bf16 on the same (representable) weights: e4m3 activations round each
    # projection's input by ~3.6% (RMS), which 16 projections of a random model carry to
    # ~12% of the logits; a wrong scale or tile would be off by far more
    got_logits, want_logits = _prefill_logits(got, prompts), _prefill_logits(want, prompts)
    assert _rel(got_logits, want_logits) < 0.2


# -- the hand-over ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cuda_ipc", "nixl"])
def test_fp8_blocks_hand_over_exactly(backend):
    config = EngineConfig(model="dummy:Qwen3-0.6B", device="cuda", num_blocks=128,
                          max_num_seqs=8, show_progress=False, **FP8_ENGINE)
    _exact_hand_overs(config, backend, random_prompts([7, 16, 45, 300], vocab=512, seed=41))
