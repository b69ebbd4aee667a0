"""FP8 on CPU: weights from both checkpoint formats users download and quantized at load give
exactly transformers' tokens on the dequantized weights; the FP8 KV cache (emulated by the torch
backend) with prefix caching; FP8 blocks through the hand-over at a quarter of float32's bytes;
a bf16 sender refused by an FP8 receiver before any byte moves."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from engine.quantization import Fp8Scheme, parse_quantization_config
from engine.tiny import write_random_qwen3
from kernels.fp8 import (FP8, dequantize, fp8_linear, quantize_per_block, quantize_per_channel,
                         quantize_rows_reference, w8a8_reference)
from kvtransfer import KVLayout, LayoutMismatchError
from kvtransfer.backends.local import LocalFabric
from kvtransfer.types import check_compatible
from prefill_worker.server import PrefillServer
from tests.models import hf_greedy, random_prompts
from tests.roles import PrefillHandle, capture_landed_kv, capture_pushed_kv, run_to_idle

DIMS = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}
COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                              "dynamic": False, "symmetric": True},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                        "dynamic": True, "symmetric": True}}},
              "ignore": ["lm_head", "model.layers.1.mlp.down_proj"]}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True)
LENGTHS = [1, 9, 16, 40]


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def fp8_checkpoint(folder: Path, source: Path, config: dict) -> Path:
    """An FP8 checkpoint of ``source``'s projections in the format ``config`` names (the
    reference keeps the float32 weights, which must be exactly representable already)."""
    shutil.copytree(source, folder)
    tensors = load_file(str(source / "model.safetensors"))
    scheme = parse_quantization_config(config)
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if _is_projection(name) and scheme.quantizes(module):
            q, s = (quantize_per_block(t, scheme.block) if scheme.block
                    else quantize_per_channel(t))
            assert torch.equal(dequantize(q, s, scheme.block), t)  # exactly representable
            out[name], out[f"{module}.{scheme.scale_name}"] = q, s
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def representable(folder: Path, source: Path, quantize, keep=()) -> Path:
    """``source`` with every projection replaced by its FP8 round trip (``quantize``): weights
    an FP8 checkpoint holds exactly; ``keep``: modules left as they are."""
    shutil.copytree(source, folder)
    tensors = load_file(str(source / "model.safetensors"))
    for name, t in tensors.items():
        if _is_projection(name) and name.removesuffix(".weight") not in keep:
            q, s = quantize(t)
            tensors[name] = dequantize(q, s, getattr(quantize, "block", None))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _blocks(t):
    return quantize_per_block(t, (128, 128))


_blocks.block = (128, 128)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return write_random_qwen3(tmp_path_factory.mktemp("fp8") / "plain", DIMS, vocab_size=256,
                              tie_word_embeddings=False, initializer_range=0.2, seed=3)


def _same_as_transformers(model_dir: Path, reference_dir: Path, **kw) -> LLM:
    prompts = random_prompts(LENGTHS, seed=5)
    _, reference = hf_greedy(reference_dir, prompts, GREEDY.max_tokens)
    llm = LLM(str(model_dir), device="cpu", **kw)
    for out, (hf_tokens, hf_logits) in zip(llm.generate(prompts, GREEDY), reference):
        assert out.token_ids == hf_tokens
        hf_logprobs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(hf_tokens)[:, None])
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs[:, 0], atol=1e-4,
                                   rtol=1e-4)
    return llm


def test_qwen_block_fp8_checkpoint_matches_transformers_on_dequantized_weights(plain, tmp_path):
    reference = representable(tmp_path / "ref", plain, _blocks)
    ckpt = fp8_checkpoint(tmp_path / "fp8", reference, QWEN_FP8)
    llm = _same_as_transformers(ckpt, reference)
    assert llm.engine.weights_name == "fp8 (fp8, block128x128)"


def test_compressed_tensors_checkpoint_matches_transformers_and_keeps_ignored_layers(plain,
                                                                                    tmp_path):
    keep = ("model.layers.1.mlp.down_proj",)
    reference = representable(tmp_path / "ref", plain, quantize_per_channel, keep)
    ckpt = fp8_checkpoint(tmp_path / "fp8", reference, COMPRESSED)
    stored = load_file(str(ckpt / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32  # ignored
    llm = _same_as_transformers(ckpt, reference)
    assert llm.engine.weights_name == "fp8 (compressed-tensors, channel)"


def test_quantization_fp8_on_load_matches_transformers_on_the_rounded_weights(plain, tmp_path):
    reference = representable(tmp_path / "ref", plain, quantize_per_channel)
    llm = _same_as_transformers(plain, reference, quantization="fp8")
    assert llm.engine.weights_name == "fp8 (on-the-fly, channel)"
    # the embeddings and the LM head keep the checkpoint's values
    lm_head = load_file(str(plain / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(llm.engine.model.lm_head.weight, lm_head)


def test_dummy_model_quantized_at_load_runs():
    llm = LLM("dummy:Qwen3-0.6B", device="cpu", quantization="fp8", num_blocks=16,
              max_model_len=64, kv_cache_dtype="fp8")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq"}, "quantization 'awq' is not supported"),
    ({**QWEN_FP8, "activation_scheme": "static"}, "static activation scales"),
    ({**COMPRESSED, "config_groups": {"g": {**COMPRESSED["config_groups"]["group_0"],
                                             "input_activations": None}}}, "weight-only"),
    ({**COMPRESSED, "ignore": ["model.layers.0.self_attn.q_proj"]}, "only some of"),
])
def test_unsupported_quantization_configs_are_refused_clearly(plain, tmp_path, config, message):
    folder = shutil.copytree(plain, tmp_path / "bad")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu")


def test_unknown_quantization_option_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


def test_ignore_entries_match_names_and_patterns():
    scheme = Fp8Scheme("compressed-tensors", ignore=("lm_head", "re:.*layers\\.3\\..*"))
    assert not scheme.quantizes("lm_head")
    assert not scheme.quantizes("model.layers.3.mlp.down_proj")
    assert scheme.quantizes("model.layers.2.mlp.down_proj")


# -- the kernels' references ------------------------------------------------------------------
def test_fp8_round_trips_and_references():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    q, s = quantize_per_channel(w)
    assert q.dtype == FP8 and s.shape == (300, 1)
    assert ((dequantize(q, s) - w).abs() / w.abs().amax(1, keepdim=True)).max() < 2 ** -4
    qb, sb = quantize_per_block(w, (128, 128))
    assert sb.shape == (3, 2)
    assert ((dequantize(qb, sb, (128, 128)) - w).norm() / w.norm()) < 0.05
    x = torch.randn(5, 200, generator=g)
    xq, xs = quantize_rows_reference(x, 128)
    assert xs.shape == (5, 2)
    exact = x @ w.t()
    for got in (w8a8_reference(x, q, s), w8a8_reference(x, qb, sb, (128, 128)),
                fp8_linear(x, q, s, None, None)):
        assert ((got - exact).norm() / exact.norm()) < 0.08


def test_norm_and_silu_hand_an_fp8_projection_rows_quantized_as_it_would():
    """Where an FP8 projection would quantize its input rows per token itself (channel format,
    rows beyond the one-row and skinny kernels), the norm before it (``norm_then``) and the
    SiLU before the down projection write them quantized instead: the same output (the CUDA
    kernels are checked against these references in tests/test_gpu_fp8.py)."""
    from engine.models.layers import Linear, RMSNorm, norm_then
    from engine.models.qwen3 import Qwen3MLP
    from kernels.gemv import GemvConfig
    from kernels.norm import rmsnorm_reference

    g = torch.Generator().manual_seed(1)
    proj = Linear(64, 96, bias=False)
    q, s = quantize_per_channel(torch.randn(96, 64, generator=g))
    proj.weight = torch.nn.Parameter(q, requires_grad=False)
    proj.weight_scale = torch.nn.Parameter(s, requires_grad=False)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=g) + 0.5
    x, residual = torch.randn(20, 64, generator=g), torch.randn(20, 64, generator=g)
    assert proj.takes_quantized(20)
    out, new_residual = norm_then(proj, norm, x, residual)
    normed, expected_residual = rmsnorm_reference(x, norm.weight, 1e-6, residual)
    assert torch.equal(out, fp8_linear(normed, q, s, None, None))
    assert torch.equal(new_residual, expected_residual)
    out, new_residual = norm_then(proj, norm, x, None)  # the first layer: no residual yet
    assert torch.equal(out, fp8_linear(rmsnorm_reference(x, norm.weight, 1e-6), q, s, None,
                                       None)) and new_residual is x
    proj.gemv_config = GemvConfig(4, 64, 4, 2)  # rows its own kernels take in bf16
    assert not proj.takes_quantized(1) and not proj.takes_quantized(16)
    assert proj.takes_quantized(17)
    proj.fp8_block = (128, 128)
    assert not proj.takes_quantized(64)

    from engine.parallel import tp
    assert tp().size == 1
    mlp = Qwen3MLP.__new__(Qwen3MLP)
    torch.nn.Module.__init__(mlp)
    mlp.group = tp()
    mlp.down_proj = Linear(48, 64, bias=False)
    qd, sd = quantize_per_channel(torch.randn(64, 48, generator=g))
    mlp.down_proj.weight = torch.nn.Parameter(qd, requires_grad=False)
    mlp.down_proj.weight_scale = torch.nn.Parameter(sd, requires_grad=False)
    gate_up = torch.randn(20, 96, generator=g)
    from kernels import silu_and_mul_reference
    assert torch.equal(mlp(gate_up), fp8_linear(silu_and_mul_reference(gate_up), qd, sd, None,
                                                None))


def test_the_fp8_lm_head_needs_fp8_matmuls_and_computes_from_the_rounded_head():
    """``fp8_lm_head`` is refused where there are no FP8 matmuls (here: float32 on the CPU), and
    the logits it gives are those of the e4m3 head (as W8A8 computes them), near the head's."""
    with pytest.raises(ValueError, match="fp8_lm_head: needs FP8 matmuls"):
        LLM("tiny", device="cpu", show_progress=False, fp8_lm_head=True)
    model = LLM("tiny", device="cpu", show_progress=False).engine.model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    exact = model.compute_logits(hidden)
    model.quantize_lm_head()
    w, scale = model.lm_head_fp8
    assert w.dtype == FP8 and scale.shape == (model.config.vocab_size, 1)
    got = model.compute_logits(hidden)
    assert torch.equal(got, w8a8_reference(hidden, w, scale).float())
    assert ((got - exact).norm() / exact.norm()) < 0.08
    out = torch.full_like(got, float("nan"))  # a decode graph's static buffer
    assert model.compute_logits(hidden, out=out) is out and torch.equal(out, got)


def test_logits_into_a_buffer_are_the_rounded_head_output_converted_there():
    """A decode graph has the head's bf16 output converted into its float32 buffer (no float32
    copy in between): the same values as the logits returned."""
    model = LLM("tiny", device="cpu", dtype="bfloat16", show_progress=False).engine.model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(3),
                         dtype=torch.bfloat16)
    got = model.compute_logits(hidden)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.nn.functional.linear(hidden, model.lm_head_weight).float())
    out = torch.full((4, model.config.vocab_size), float("nan"))
    assert model.compute_logits(hidden, out=out[:3]).data_ptr() == out.data_ptr()
    assert torch.equal(out[:3], got) and out[3].isnan().all()


# -- the FP8 KV cache -------------------------------------------------------------------------
def test_fp8_kv_cache_halves_block_bytes_and_keeps_prefix_hits_exact():
    fp32 = LLM("tiny", kv_cache_memory_gb=0.01)
    fp8 = LLM("tiny", kv_cache_memory_gb=0.01, kv_cache_dtype="fp8")
    assert fp8.engine.kv_cache_spec().layout.dtype == "float8_e4m3fn"
    assert fp8.engine.runner.kv_cache.dtype == FP8
    assert fp8.engine.runner.block_bytes * 4 == fp32.engine.runner.block_bytes
    assert fp8.engine.runner.num_blocks // 4 == fp32.engine.runner.num_blocks  # same memory
    prompt = random_prompts([40], vocab=512, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
    miss = fp8.generate([prompt], params)[0]
    hit = fp8.generate([prompt], params)[0]  # the prompt's full blocks come from the cache
    assert fp8.engine.pool.num_cached_blocks > 0
    assert hit.token_ids == miss.token_ids and hit.logprobs == miss.logprobs
    # e4m3 keys and values: close to the float32 cache's next-token distribution
    ref = fp32.generate([prompt], params)[0]
    assert abs(miss.logprobs[0] - ref.logprobs[0]) < 0.1


def test_fp8_cache_holds_rounded_keys_and_values():
    llm = LLM("tiny", num_blocks=8, kv_cache_dtype="fp8")
    ref = LLM("tiny", num_blocks=8)
    prompt = random_prompts([16], vocab=512, seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], params)
    ref.generate([prompt], params)
    block = 1  # the first block after the null block; layer 0, whose input is the same
    got = llm.engine.runner.kv_cache[0, block].float()
    want = ref.engine.runner.kv_cache[0, block].clamp(-448, 448).to(FP8).float()
    assert torch.equal(got, want)


# -- FP8 blocks through the hand-over ---------------------------------------------------------
def test_fp8_blocks_through_the_hand_over_match_colocated():
    config = EngineConfig(model="tiny", num_blocks=64, kv_cache_dtype="fp8", show_progress=False)
    fabric = LocalFabric()
    prefill = PrefillServer(config, "local", fabric=fabric)
    decode = DecodeServer(config, "local", PrefillHandle(prefill), fabric=fabric, disaggregation=ALWAYS)
    pushed, landed = capture_pushed_kv(prefill), capture_landed_kv(decode)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts([20, 50], vocab=512, seed=31)
    expected = LLM("tiny", num_blocks=64, kv_cache_dtype="fp8").generate(prompts, params)

    try:
        for i, (prompt, want) in enumerate(zip(prompts, expected)):
            tokens, result = run_to_idle(prefill, decode, prompt, f"f{i}", params)
            assert tokens == want.token_ids
            assert torch.equal(pushed[f"f{i}"], landed[f"f{i}"])
            # one byte a value: a quarter of the float32 cache's bytes
            assert result.transfer.bytes == pushed[f"f{i}"].numel()
            assert result.transfer.bytes == (result.transfer.blocks_sent
                                             * decode.aengine.engine.runner.block_bytes)
    finally:
        prefill.close()
        decode.close()


def test_bf16_sender_to_fp8_receiver_is_refused_naming_both():
    layout = dict(model="m", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
    with pytest.raises(LayoutMismatchError, match="dtype: local 'float8_e4m3fn' != peer "
                                                  "'bfloat16'"):
        check_compatible(KVLayout(dtype="float8_e4m3fn", **layout),
                         KVLayout(dtype="bfloat16", **layout))


def test_a_one_row_layer_ends_its_gate_up_in_the_silu_only_where_nothing_else_folds_it(
        monkeypatch):
    """``Qwen3MLP.glu_in_projection``: one row, a one-row kernel config, no norm folded in
    front, the channel FP8 format or bf16, and an intermediate size wider than the down
    projection's own SiLU fold; the layer's output is then that of the SiLU kernel's path
    (here through the CPU references; the kernels' bytes: tests/test_kernels.py)."""
    from engine.config import ModelConfig
    from engine.models import qwen3
    from engine.models.layers import RotaryEmbedding
    from kernels.gemv import SILU_FUSE_MAX_K, GemvConfig

    def layer_for(inter: int) -> qwen3.Qwen3DecoderLayer:
        cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=inter,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                          max_position_embeddings=128, tie_word_embeddings=True)
        layer = qwen3.Qwen3DecoderLayer(cfg, RotaryEmbedding(16, 128, 1e6))
        g = torch.Generator().manual_seed(inter)
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0)
        for m in layer.modules():
            if isinstance(m, qwen3.Linear):
                m.gemv_config = GemvConfig(4, 64, 4, 2)
        return layer

    wide, narrow = layer_for(SILU_FUSE_MAX_K + 64), layer_for(SILU_FUSE_MAX_K)
    assert wide.mlp.glu_in_projection(1) and not wide.mlp.glu_in_projection(2)
    assert not narrow.mlp.glu_in_projection(1)  # the down projection folds it there
    g = torch.Generator().manual_seed(5)
    o, residual = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    out = wide.after_attention(o, residual)
    monkeypatch.setattr(qwen3, "GLU_EPILOGUE", False)
    assert not wide.mlp.glu_in_projection(1)
    want = wide.after_attention(o, residual)
    assert torch.allclose(out[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1], want[1])
    monkeypatch.setattr(qwen3, "GLU_EPILOGUE", True)
    wide.mlp.gate_up_proj.fuse_norm = True  # the norm folded in front: not both
    assert not wide.mlp.glu_in_projection(1)
    wide.mlp.gate_up_proj.fuse_norm = False
    wide.mlp.gate_up_proj.fp8_block = (128, 128)  # block scales: a pair spans two tile rows
    assert not wide.mlp.glu_in_projection(1)
