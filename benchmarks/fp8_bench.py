"""FP8 kernels on the GPU host, next to bf16: the decode projections of Qwen3 shapes at several
batch sizes, and FlashInfer attention over an FP8 KV cache.

    python -m benchmarks.fp8_bench --models dummy:Qwen3-8B dummy:Qwen3-32B --rows 1 64 256 2048
    python -m benchmarks.fp8_bench --tasks attention

``linear``: per projection and batch size M, µs per call (a CUDA graph of calls over copies of
the weight that spill L2) for bf16 cuBLAS, the bf16 Triton skinny matmul (M = 1), and the FP8
paths of ``kernels/fp8.py``: the one-row kernel over a grid of tiles, ``torch._scaled_mm`` with
per-token activations (channel format), the Triton block-scaled GEMM (128×128 format) and, where
they run, FlashInfer's block-scaled GEMM and torch's block-wise ``_scaled_mm``. Each FP8 result is
checked against its float32 reference. The last table sums one decode step's projections
(× layers) per path, the figure the engine's step time follows.

``attention``: FlashInfer decode and prefill over an FP8 e4m3 cache against the bf16 cache and the
torch reference, with Qwen3-8B's heads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.engine_bench import ceilings, graph_us
from benchmarks.gemv_bench import SPILL_BYTES, projections
from engine.model_source import resolve_model
from kernels.fp8 import (FP8, fp8_block_mm, fp8_block_scaled_mm, fp8_gemv, fp8_gemv_config,
                         fp8_gemv_reference, fp8_scaled_mm, fp8_skinny_mm, quantize_per_block,
                         quantize_per_channel,
                         quantize_rows, w8a8_reference)
from kernels.gemv import GemvConfig, config_for, gemv

BLOCK = (128, 128)
GEMV_GRID = [GemvConfig(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
    (4, 8), (1024, 2048), (4, 8), (2, 3, 4))]
SKINNY_GRID = list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 5)))


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _flashinfer_block(x, w, s):
    from flashinfer.gemm import fp8_blockscale_gemm_sm90
    return fp8_blockscale_gemm_sm90(x, w, None, s, out_dtype=torch.bfloat16)


def _torch_block(x, w, s):
    xq, xs = quantize_rows(x, 128)
    return torch._scaled_mm(xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=s.t(),
                            out_dtype=torch.bfloat16)


def _grid(r: dict, label: str, grid, make, weights, ref) -> None:
    """The fastest config of a grid (each checked against ``ref``)."""
    best = None
    for cfg in grid:
        res = {}
        _try("t", make(cfg), weights, ref, res, 1e-2)
        if isinstance(res["t"], float) and (best is None or res["t"] < best[0]):
            best = (res["t"], tuple(cfg))
    if best:
        r[label + " best"], r[label + " best config"] = best


def _try(label: str, fn, weights, ref, results: dict, tol: float) -> None:
    """Time ``fn(weight)`` if it runs and is right (first call timed separately: JIT builds);
    ``ref`` None: not checked."""
    try:
        t0 = time.perf_counter()
        out = fn(weights[0])
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        err = 0.0 if ref is None else _err(out, ref)
        if not err <= tol:
            results[label] = f"wrong (rel err {err:.3g})"
            return
        results[label] = round(graph_us(fn, weights), 2)
        if first > 2:
            results[label + " first call s"] = round(first, 1)
    except Exception as exc:  # noqa: BLE001 - a path this GPU or build lacks
        results[label] = f"{type(exc).__name__}: {str(exc)[:80]}"


def linear(models, rows_list, gbs: float, flashinfer_block: bool = False) -> list[dict]:
    out = []
    for model in models:
        layers = resolve_model(model).config.num_hidden_layers
        for name, (n, k) in projections(model).items():
            bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                    for _ in range(max(2, min(32, SPILL_BYTES // (n * k * 2))))]
            chan = [quantize_per_channel(w) for w in bf16]
            block = [quantize_per_block(w, BLOCK) for w in bf16]
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = {"model": model, "proj": name, "M": m, "N": n, "K": k, "layers": layers}
                r["bf16 cublas"] = round(graph_us(lambda w: F.linear(x, w), bf16), 2)
                if m == 1:
                    r["bf16 triton"] = round(graph_us(lambda w: gemv(x, w, config_for(n, k)),
                                                      bf16), 2)
                    ref_c = fp8_gemv_reference(x, *chan[0])
                    ref_b = fp8_gemv_reference(x, *block[0], BLOCK)
                    _try("fp8 gemv channel", lambda c: fp8_gemv(x, *c, None, fp8_gemv_config(n, k)),
                         chan, ref_c, r, 1e-2)
                    _try("fp8 gemv block", lambda c: fp8_gemv(x, *c, BLOCK, fp8_gemv_config(n, k)),
                         block, ref_b, r, 1e-2)
                    _grid(r, "fp8 gemv channel", GEMV_GRID,
                          lambda cfg: (lambda c: fp8_gemv(x, *c, None, cfg)), chan, ref_c)
                elif m <= 64:
                    ref_c = fp8_gemv_reference(x, *chan[0])
                    ref_b = fp8_gemv_reference(x, *block[0], BLOCK)
                    _try("fp8 skinny channel", lambda c: fp8_skinny_mm(x, *c), chan, ref_c, r, 1e-2)
                    _try("fp8 skinny block", lambda c: fp8_skinny_mm(x, *c, BLOCK), block, ref_b, r,
                         1e-2)
                    _grid(r, "fp8 skinny channel", SKINNY_GRID,
                          lambda cfg: (lambda c: fp8_skinny_mm(x, *c, None, *cfg)), chan, ref_c)
                ref_c = w8a8_reference(x, *chan[0])
                ref_b = w8a8_reference(x, *block[0], BLOCK)
                _try("fp8 scaled_mm channel", lambda c: fp8_scaled_mm(x, *c), chan, ref_c, r, 2e-2)
                xq, xs = quantize_rows(x)
                _try("fp8 scaled_mm raw", lambda c: torch._scaled_mm(
                    xq, c[0].t(), scale_a=xs, scale_b=c[1].reshape(1, -1),
                    out_dtype=torch.bfloat16), chan, ref_c, r, 2e-2)
                _try("fp8 quantize rows", lambda c: quantize_rows(x), chan[:2], None, r, 0)
                if m > 64:
                    _try("fp8 triton block", lambda c: fp8_block_mm(x, *c, BLOCK), block, ref_b, r,
                         2e-2)
                    _try("fp8 block_scaled_mm", lambda c: fp8_block_scaled_mm(x, *c, BLOCK),
                         block, ref_b, r, 2e-2)
                    if flashinfer_block:  # a DeepGEMM JIT build on first use
                        _try("fp8 flashinfer block", lambda c: _flashinfer_block(x, *c), block,
                             ref_b, r, 5e-2)
                _try("fp8 torch block", lambda c: _torch_block(x, *c), block, ref_b, r, 5e-2)
                r["bf16 floor us"] = round(n * k * 2 / (gbs * 1e3), 2)
                out.append(r)
                print(json.dumps(r), flush=True)
            del bf16, chan, block
            torch.cuda.empty_cache()
    return out


def step_table(rows: list[dict]) -> None:
    """One decode step's projections, summed over the four and × layers, per path (ms)."""
    keys = ["bf16 cublas", "bf16 triton", "fp8 gemv channel", "fp8 gemv block",
            "fp8 skinny channel", "fp8 skinny block", "fp8 scaled_mm channel",
            "fp8 scaled_mm raw", "fp8 quantize rows", "fp8 block_scaled_mm", "fp8 torch block"]
    print("\n| model | M | " + " | ".join(keys) + " |")
    print("| --- | ---: |" + " ---: |" * len(keys))
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["M"]), []).append(r)
    for (model, m), rs in groups.items():
        cells = []
        for key in keys:
            vals = [r.get(key) for r in rs]
            ok = all(isinstance(v, float) for v in vals)
            cells.append(f"{sum(vals) * rs[0]['layers'] / 1e3:.2f}" if ok else "—")
        print(f"| {model} | {m} | " + " | ".join(cells) + " |")


def attention(contexts=(1024, 8192), batches=(1, 64)) -> list[dict]:
    """FlashInfer decode and prefill over FP8 and bf16 caches, against the torch reference."""
    from engine.attention.flashinfer_backend import FlashInferBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.forward_context import AttentionMetadata
    from kernels.kv_store import to_cache_dtype
    hq, hk, d, bs = 32, 8, 128, 16
    rows = []
    for ctx, batch in itertools.product(contexts, batches):
        pages = -(-ctx // bs)
        nblocks = batch * pages + 1
        kv_bf16 = torch.randn(nblocks, 2, hk, bs, d, device="cuda", dtype=torch.bfloat16)
        for dtype in (torch.bfloat16, FP8):
            cache = kv_bf16 if dtype == torch.bfloat16 else to_cache_dtype(kv_bf16, FP8)
            for decode in (True, False):
                nq = 1 if decode else min(ctx, 512)
                if not decode and batch > 1:
                    continue
                q = torch.randn(batch * nq, hq, d, device="cuda", dtype=torch.bfloat16)
                meta = AttentionMetadata(
                    slot_mapping=None, query_start_loc=[i * nq for i in range(batch + 1)],
                    context_lens=[ctx] * batch,
                    kv_indptr=torch.arange(0, batch * pages + 1, pages, dtype=torch.int32),
                    kv_indices=torch.arange(1, batch * pages + 1, dtype=torch.int32),
                    kv_last_page_len=torch.full((batch,), ctx - (pages - 1) * bs,
                                                dtype=torch.int32),
                    block_size=bs, is_decode_only=decode)
                fi = FlashInferBackend(hq, hk, d, d ** -0.5, bs, torch.device("cuda"),
                                       torch.bfloat16, kv_dtype=dtype)
                ref_backend = TorchAttentionBackend(hq, hk, d, d ** -0.5, bs)
                meta.slot_mapping = torch.zeros(1, device="cuda")
                fi.plan(meta)
                out = fi.forward(q, cache, meta)
                ref_backend.plan(meta)
                ref = ref_backend.forward(q, cache, meta)
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(20):
                    fi.forward(q, cache, meta)
                end.record()
                end.synchronize()
                row = {"ctx": ctx, "batch": batch, "kv": str(dtype)[6:],
                       "phase": "decode" if decode else f"prefill {nq}",
                       "us": round(start.elapsed_time(end) * 1e3 / 20, 1),
                       "rel_err_vs_torch": round(_err(out, ref), 5),
                       "kv_MB": round(batch * pages * 2 * hk * bs * d * cache.element_size()
                                      / 1e6, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["linear", "attention"])
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-8B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 64, 256, 2048])
    ap.add_argument("--flashinfer-block", action="store_true",
                    help="also FlashInfer's block-scaled FP8 GEMM (JIT-built on first use)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ceil = ceilings()
    print(json.dumps(ceil), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "ceilings": ceil}
    if "attention" in args.tasks:
        result["attention"] = attention()
    if "linear" in args.tasks:
        result["linear"] = linear(args.models, args.rows, ceil["copy_GBps"],
                                  args.flashinfer_block)
        step_table(result["linear"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
