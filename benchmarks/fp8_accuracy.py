"""How far FP8 moves the next-token distribution (reported, not a pass/fail: ``dummy:`` models
have random weights).

    python -m benchmarks.fp8_accuracy --models dummy:Qwen3-0.6B dummy:Qwen3-8B --formats

``--lm-head``: what ``fp8_lm_head`` costs on top of FP8 weights, per model (and per checkpoint
format with ``--formats``).

``sizes``: for each model, the next-token distribution at every position of 32 prompts of 64
tokens, bf16 weights against FP8 weights quantized at load (``quantization="fp8"``): mean KL
divergence KL(bf16 || fp8) and top-1 agreement. ``--kv-cache-dtype fp8`` adds the FP8 cache to
the FP8 side. ``--formats``: the two FP8 checkpoint formats (Qwen's 128×128 blocks,
compressed-tensors per channel) written from dummy Qwen3-0.6B's weights, each against a bf16
checkpoint of its own dequantized weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

PROMPTS, POSITIONS = 32, 64
DEVICE = "cuda"


def all_position_logprobs(engine: LLMEngine, prompts) -> torch.Tensor:
    """log-softmax of the next-token logits at every position of every prompt (one prefill
    step), on the host: ``[prompts × positions, vocab]``."""
    runner = engine.runner
    prepare = runner.prepare

    def every_row(batch):
        step = prepare(batch)
        step.logit_rows = list(range(len(step.ids)))
        return step

    runner.prepare = every_row
    try:
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
        logits = runner.execute(engine.scheduler.schedule())
    finally:
        runner.prepare = prepare
    out = torch.log_softmax(logits.float(), dim=-1).cpu()
    for p in list(engine.scheduler.requests):
        engine.abort_request(p)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"mean_kl": round(kl.mean().item(), 6), "max_kl": round(kl.max().item(), 5),
            "top1_agreement": round((ref.argmax(-1) == got.argmax(-1)).float().mean().item(), 4)}


def _logprobs(model: str, prompts, **kw) -> torch.Tensor:
    engine = LLMEngine(EngineConfig(model=model, device=DEVICE, show_progress=False,
                                    max_num_batched_tokens=PROMPTS * POSITIONS,
                                    max_model_len=1024, enforce_eager=True, **kw))
    out = all_position_logprobs(engine, prompts)
    del engine
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab - 10, (PROMPTS, POSITIONS), generator=g).tolist()


def sizes(models, kv_cache_dtype: str) -> list[dict]:
    rows = []
    for model in models:
        prompts = _prompts(151936)
        ref = _logprobs(model, prompts)
        got = _logprobs(model, prompts, quantization="fp8", kv_cache_dtype=kv_cache_dtype)
        row = {"model": model, "fp8": "weights" + (" + KV" if kv_cache_dtype == "fp8" else ""),
               **compare(ref, got)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def lm_head(models) -> list[dict]:
    """``fp8_lm_head``'s own cost: FP8 weights with the bf16 head against the same with the FP8
    head, and bf16 against FP8 weights with either head."""
    rows = []
    for model in models:
        prompts = _prompts(151936)
        bf16 = _logprobs(model, prompts)
        fp8 = _logprobs(model, prompts, quantization="fp8")
        head = _logprobs(model, prompts, quantization="fp8", fp8_lm_head=True)
        for what, ref, got in (("fp8 weights: bf16 head -> fp8 head", fp8, head),
                               ("bf16 -> fp8 weights, bf16 head", bf16, fp8),
                               ("bf16 -> fp8 weights, fp8 head", bf16, head)):
            rows.append({"model": model, "compare": what, **compare(ref, got)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def formats(model: str = "dummy:Qwen3-0.6B", fp8_lm_head: bool = False) -> list[dict]:
    """Write ``model``'s random weights as the two FP8 checkpoint formats and as bf16
    checkpoints of their dequantized weights; compare each pair (``fp8_lm_head``: and each FP8
    checkpoint with its bf16 head against the same with the FP8 head)."""
    from safetensors.torch import save_file

    from engine.loader import load_model
    from engine.model_source import resolve_model
    from kernels.fp8 import dequantize, quantize_per_block, quantize_per_channel
    from tests.test_fp8 import COMPRESSED, QWEN_FP8

    source = resolve_model(model)
    weights = load_model(source, torch.device(DEVICE), torch.bfloat16).state_dict()
    tmp = Path(tempfile.mkdtemp(prefix="fp8-formats-"))
    cfg = json.loads(json.dumps(source.config.__dict__, default=str))
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
           **{k: v for k, v in cfg.items() if k not in ("quantization", "eos_token_id")},
           "torch_dtype": "bfloat16"}
    rows = []
    for name, config, quantize, block in (
            ("qwen fp8 (128x128 blocks)", QWEN_FP8, quantize_per_block, (128, 128)),
            ("compressed-tensors (channel)", COMPRESSED, quantize_per_channel, None)):
        fp8, ref = {}, {}
        ignored = tuple(config.get("ignore", ()))  # compressed-tensors: one layer kept in bf16
        for key, t in weights.items():
            ckpt = _checkpoint_names(key)
            if key.endswith(("qkv_proj.weight", "gate_up_proj.weight", "o_proj.weight",
                             "down_proj.weight")) and key.removesuffix(".weight") not in ignored:
                for ckpt_key, part in zip(ckpt, _shards(key, t, source.config)):
                    q, s = quantize(part, block) if block else quantize(part)
                    fp8[ckpt_key] = q.cpu()
                    scale_name = "weight_scale_inv" if block else "weight_scale"
                    fp8[ckpt_key.removesuffix("weight") + scale_name] = s.cpu()
                    ref[ckpt_key] = dequantize(q, s, block).to(torch.bfloat16).cpu()
            else:
                for ckpt_key, part in zip(ckpt, _shards(key, t, source.config)):
                    fp8[ckpt_key] = ref[ckpt_key] = part.cpu()
        for folder, tensors, qcfg in ((tmp / "fp8", fp8, config), (tmp / "ref", ref, None)):
            folder.mkdir(exist_ok=True)
            save_file(tensors, str(folder / "model.safetensors"))
            (folder / "config.json").write_text(json.dumps(
                {**raw, **({"quantization_config": qcfg} if qcfg else {})}))
        prompts = _prompts(source.config.vocab_size)
        native = _logprobs(str(tmp / "fp8"), prompts)
        rows.append({"format": name, "model": model,
                     **compare(_logprobs(str(tmp / "ref"), prompts), native)})
        if fp8_lm_head:
            rows.append({"format": name, "model": model,
                         "compare": "bf16 head -> fp8 head",
                         **compare(native, _logprobs(str(tmp / "fp8"), prompts,
                                                     fp8_lm_head=True))})
        for row in rows[-1 - fp8_lm_head:]:
            print(json.dumps(row), flush=True)
    return rows


def _checkpoint_names(key: str) -> list[str]:
    for packed, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                          ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{packed}." in key:
            return [key.replace(packed, p) for p in parts]
    return [key]


def _shards(key: str, t: torch.Tensor, cfg) -> list[torch.Tensor]:
    if ".qkv_proj." in key:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return list(t.split((q, kv, kv)))
    if ".gate_up_proj." in key:
        return list(t.chunk(2))
    return [t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-0.6B", "dummy:Qwen3-8B"])
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--formats", action="store_true")
    ap.add_argument("--lm-head", action="store_true",
                    help="what fp8_lm_head costs: per model, and per checkpoint format with "
                         "--formats (instead of the sizes comparison)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name()}
    if args.lm_head:
        result["lm_head"] = lm_head(args.models)
    else:
        result["sizes"] = sizes(args.models, args.kv_cache_dtype)
    if args.formats:
        result["formats"] = formats(fp8_lm_head=args.lm_head)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
