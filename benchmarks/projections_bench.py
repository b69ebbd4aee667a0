"""The decode projections' kernels, one tool:
``python -m benchmarks.projections_bench {bf16|fp8|quantized} [options]``.

``bf16``: decode projections of Qwen3 shapes, one kernel each: cuBLAS (``F.linear``) against the
Triton skinny matmul (``kernels/gemv.py``) over a grid of tile configs. Each figure is a CUDA graph of
calls over enough copies of the weight to spill L2, so every call streams its weight from HBM.

    python -m benchmarks.projections_bench bf16 --models dummy:Qwen3-0.6B dummy:Qwen3-8B --rows 1 4
    python -m benchmarks.projections_bench bf16 --streaming  # one row: the weight stream's variants

``--streaming`` compares, for one row, the kernel against variants that load the weight with an
evict-first cache hint and bigger K tiles, and prints the read rate of a plain reduction (the
ceiling for a kernel that only reads).

``fp8``: FP8 kernels on the GPU host, next to bf16: the decode projections of Qwen3 shapes at
several batch sizes, and FlashInfer attention over an FP8 KV cache.

    python -m benchmarks.projections_bench fp8 --models dummy:Qwen3-8B dummy:Qwen3-32B \\
        --rows 1 64 256 2048
    python -m benchmarks.projections_bench fp8 --tasks attention

``linear``: per projection and batch size M, µs per call (a CUDA graph of calls over copies of
the weight that spill L2) for bf16 cuBLAS, the bf16 Triton skinny matmul (M = 1), and the FP8
paths of ``kernels/fp8.py``: the one-row kernel over a grid of tiles, the few-row kernel (2-16
rows) as the engine runs it and over a grid of tiles, stages and K splits, ``torch._scaled_mm``
with per-token activations (channel format), the Triton block-scaled GEMM (128×128 format) and,
where they run, FlashInfer's block-scaled GEMM and torch's block-wise ``_scaled_mm``. Each FP8
result is checked against its float32 reference. The last table sums one decode step's projections
(× layers) per path, the figure the engine's step time follows.

``attention``: FlashInfer decode and prefill over an FP8 e4m3 cache against the bf16 cache and the
torch reference, with Qwen3-8B's heads.

``quantized``: the RMSNorm and SiLU-and-multiply kernels that write e4m3 rows for a W8A8
projection against the two kernels each replaces, at several row counts.

    python -m benchmarks.projections_bench quantized --rows 256 1024 2048

``chain``: a batch-1 decode step's projections for every layer, chained in one CUDA graph as the
engine runs them (its one-row kernels, the norm and SiLU folded where it folds them; no
attention) and the LM head (FP8 for an FP8 model, as ``fp8_lm_head`` runs it), against the bytes they read at the copy rate: with programmatic dependent launch on
and off, and, with ``--grid``, each projection's tile configs in turn (the others at the
engine's, or at their best once tried), which is how ``kernels.gemv.config_for`` and
``kernels.fp8.fp8_gemv_config`` (with ``CHAIN_WINNERS`` and ``FP8_CHAIN_WINNERS``) were chosen.

    python -m benchmarks.projections_bench chain --models dummy:Qwen3-0.6B dummy:Qwen3-8B:fp8 --grid

``--rows N`` (2-8) chains the kernels of an N-row step instead (the RMSNorm and SiLU kernels, the
few-row FP8 kernel or cuBLAS), ``--grid`` then trying the few-row FP8 kernel's tiles, warps and
K splits (``CHAIN_SKINNY_GRID``): a small batch's decode step, or a speculating step's
verification of ``1 + k`` rows.

"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.lib import ceilings, dispatch, graph_us
from engine.model_source import resolve_model
from kernels._triton import tl, triton
from kernels.fp8 import (FP8, SKINNY_MAX_ROWS, fp8_block_mm, fp8_block_scaled_mm, fp8_gemv,
                         fp8_gemv_config, fp8_gemv_reference, fp8_scaled_mm, fp8_skinny_mm,
                         quantize_per_block, quantize_per_channel, quantize_rows, w8a8_reference)
from kernels.gemv import GemvConfig, config_for, gemv


# -- bf16 ----------------------------------------------------------------------------------
SPILL_BYTES = 400 * 2**20

def projections(model: str) -> dict[str, tuple[int, int]]:
    c = resolve_model(model).config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}

CONFIGS = [GemvConfig(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
    (4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4))]

if triton is not None:
    @triton.jit
    def _stream_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVICT:
                w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs + k0)
            acc += w.to(tl.float32) * tl.load(x_ptr + k0 + cols).to(tl.float32)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))

def _stream(x, w, bn, bk, nw, ns, evict):
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _stream_kernel[(n // bn,)](x, w, y, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, EVICT=evict,
                               num_warps=nw, num_stages=ns)
    return y

def read_rate() -> float:
    a = torch.ones(2**29, dtype=torch.bfloat16, device="cuda")
    a.sum(dtype=torch.float32)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        a.sum(dtype=torch.float32)
    end.record()
    end.synchronize()
    return a.numel() * 2 * 5 / (start.elapsed_time(end) * 1e-3) / 1e9

def streaming(models) -> None:
    print(f"read rate (sum of 1 GiB): {read_rate():.0f} GB/s")
    variants = [(bn, bk, nw, ns, ev) for bn, bk, nw, ns, ev in itertools.product(
        (4, 8, 16), (512, 1024, 2048), (4, 8), (1, 2, 3), (False, True))]
    print("| model | proj | MB | engine config us | best variant us | variant (BN, BK, warps, "
          "stages, evict) | GB/s |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: |")
    from kernels.gemv import config_for
    for model in models:
        for name, (n, k) in projections(model).items():
            nbytes = n * k * 2
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(max(2, min(64, SPILL_BYTES // nbytes)))]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            base = graph_us(lambda w: gemv(x, w, config_for(n, k)), weights)
            best = None
            for v in variants:
                if n % v[0] or k % v[1]:
                    continue
                err = ((_stream(x, weights[0], *v).float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (v, err)
                us = graph_us(lambda w, v=v: _stream(x, w, *v), weights)
                if best is None or us < best[0]:
                    best = (us, v)
            print(f"| {model} | {name} | {nbytes / 1e6:.1f} | {base:.2f} | {best[0]:.2f} | "
                  f"{best[1]} | {nbytes / best[0] / 1e3:.0f} |", flush=True)
            del weights
            torch.cuda.empty_cache()

def bf16_main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-0.6B", "dummy:Qwen3-8B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default=None)
    ap.add_argument("--streaming", action="store_true",
                    help="one row: variants of the weight stream against the engine's kernel")
    args = ap.parse_args(argv)
    if args.streaming:
        streaming(args.models)
        return
    gbs = ceilings()["copy_GBps"]
    print(f"copy rate {gbs:.0f} GB/s")
    rows = []
    print("| model | proj | M | N | K | MB | cuBLAS us | cuBLAS % | Triton us | Triton % "
          "| config |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for model in args.models:
        for name, (n, k) in projections(model).items():
            nbytes = n * k * 2
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(max(2, min(64, SPILL_BYTES // nbytes)))]
            floor_us = nbytes / (gbs * 1e3)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0]).float()
                cublas = graph_us(lambda w: F.linear(x, w), weights)
                best = None
                for cfg in CONFIGS:
                    try:
                        err = ((gemv(x, weights[0], cfg).float() - ref).norm() / ref.norm()).item()
                        us = graph_us(lambda w, c=cfg: gemv(x, w, c), weights)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile
                        print(f"  skip {cfg}: {type(exc).__name__}")
                        continue
                    assert err < 1e-2, (cfg, err)
                    if best is None or us < best[0]:
                        best = (us, cfg)
                row = {"model": model, "proj": name, "M": m, "N": n, "K": k,
                       "MB": round(nbytes / 1e6, 1), "cublas_us": round(cublas, 2),
                       "triton_us": round(best[0], 2), "config": best[1]._asdict()}
                rows.append(row)
                print(f"| {model} | {name} | {m} | {n} | {k} | {row['MB']} | {cublas:.2f} | "
                      f"{100 * floor_us / cublas:.0f} | {best[0]:.2f} | "
                      f"{100 * floor_us / best[0]:.0f} | {tuple(best[1])} |", flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": gbs, "rows": rows}, f, indent=1)


# -- fp8 -----------------------------------------------------------------------------------
BLOCK = (128, 128)

GEMV_GRID = [GemvConfig(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
    (4, 8), (1024, 2048), (4, 8), (2, 3, 4))]

SKINNY_GRID = list(itertools.product((32, 64), (128, 256), (4,), (3, 5), (1, 2, 4)))

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
                elif m <= SKINNY_MAX_ROWS:  # more rows: the kernel is not asked (W8A8 runs)
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
            "fp8 skinny channel", "fp8 skinny channel best", "fp8 skinny block",
            "fp8 scaled_mm channel", "fp8 scaled_mm raw", "fp8 quantize rows",
            "fp8 block_scaled_mm", "fp8 torch block"]
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

def fp8_main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["linear", "attention"])
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-8B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 64, 256, 2048])
    ap.add_argument("--flashinfer-block", action="store_true",
                    help="also FlashInfer's block-scaled FP8 GEMM (JIT-built on first use)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
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


def _graph_us(fn, reps: int = 50) -> float:
    """µs per call of ``fn``, from a CUDA graph of ``reps`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def quantized_main(argv=None) -> None:
    """``quantized``: the norm and SiLU kernels that write their rows as e4m3 for a W8A8
    projection, against the kernel pair they replace (the bf16 kernel, then the per-row
    quantization), µs per call in a CUDA graph."""
    from kernels import rmsnorm, silu_and_mul
    from kernels.activation import silu_and_mul_quant
    from kernels.fp8 import quantize_rows
    from kernels.norm import rmsnorm_quant

    ap = argparse.ArgumentParser(description=quantized_main.__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 64, 256, 1024, 2048])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, nargs="+", default=[12288, 25600])
    args = ap.parse_args(argv)
    print("rows intermediate | norm+quant: one kernel, two kernels (us) | "
          "silu+quant: one kernel, two kernels (us)")
    for inter in args.intermediate:
        for m in args.rows:
            x = torch.randn(m, args.hidden, device="cuda", dtype=torch.bfloat16)
            r, w = torch.randn_like(x), torch.ones(args.hidden, device="cuda",
                                                   dtype=torch.bfloat16)
            gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
            row = [m, inter, _graph_us(lambda: rmsnorm_quant(x, w, 1e-6, r)),
                   _graph_us(lambda: quantize_rows(rmsnorm(x, w, 1e-6, r)[0])),
                   _graph_us(lambda: silu_and_mul_quant(gu)),
                   _graph_us(lambda: quantize_rows(silu_and_mul(gu)))]
            print(" ".join(str(round(v, 1)) for v in row), flush=True)


CHAIN_GRID = [GemvConfig(bn, bk, nw, 2) for bn, bk, nw in itertools.product(
    (2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8))]
# the few-row kernel's configs ``chain --rows N --grid`` tries: (block_n, block_k, warps,
# stages, K split)
CHAIN_SKINNY_GRID = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3,),
                                           (1, 2, 4)))


def _chain(model: str, rows: int = 1):
    """``(step, weight bytes, engine configs, shapes, grid)``: ``step(configs)`` runs one decode
    step's projections of ``rows`` rows over every layer and the LM head (``model`` ending in
    ``:fp8``: FP8 weights per channel, the head too, as ``fp8_lm_head`` runs it), with the
    kernels the engine launches at that row count: one row, the skinny matmuls with their folds;
    a few rows, the RMSNorm and SiLU kernels and, FP8, the few-row kernel (``fp8_skinny_mm``,
    its configs the tiles, warps, stages and K split), bf16, cuBLAS (no configs). ``grid``:
    the configs ``--grid`` tries for a ``(n, k)`` projection."""
    from kernels import rmsnorm, silu_and_mul
    from kernels.fp8 import SKINNY_BLOCK_K, SKINNY_BLOCK_N, fp8_skinny_mm, skinny_split
    from kernels.gemv import GLU_EPILOGUE, NORM_FUSE_MAX_K, SILU_FUSE_MAX_K, norm_gemv

    name, fp8 = (model[:-4], True) if model.endswith(":fp8") else (model, False)
    c = resolve_model(name).config
    shapes, q = projections(name), c.num_attention_heads * c.head_dim
    head_w = torch.randn(c.vocab_size, c.hidden_size, device="cuda",
                         dtype=torch.bfloat16) / c.hidden_size**0.5
    head = quantize_per_channel(head_w) if fp8 else (head_w, None)
    del head_w
    nbytes = head[0].numel() * head[0].element_size()
    layers = []
    for _ in range(c.num_hidden_layers):
        layer = {}
        for proj, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            layer[proj] = quantize_per_channel(w) if fp8 else (w, None)
            nbytes += layer[proj][0].numel() * layer[proj][0].element_size()
        layers.append(layer)
    norm_w = torch.ones(c.hidden_size, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(rows, c.hidden_size, device="cuda", dtype=torch.bfloat16)

    def linear(x, layer, proj, cfg, silu=False, glu=False):
        w, scale = layer[proj]
        if rows > 1:
            return fp8_skinny_mm(x, w, scale, None, *cfg) if fp8 else F.linear(x, w)
        if fp8:
            return fp8_gemv(x, w, scale, None, cfg, silu=silu, glu=glu)
        return gemv(x, w, cfg, silu=silu, glu=glu)

    fuse_silu = rows == 1 and c.intermediate_size <= SILU_FUSE_MAX_K
    fuse_norm = rows == 1 and not fp8 and c.hidden_size <= NORM_FUSE_MAX_K
    # as Qwen3MLP.glu_in_projection
    glu = GLU_EPILOGUE and rows == 1 and not fuse_silu and not fuse_norm

    def normed(x, res, layer, proj, cfg, glu=False):
        if fuse_norm:
            return norm_gemv(x, res, norm_w, 1e-6, layer[proj][0], cfg)
        h, res = rmsnorm(x, norm_w, 1e-6, res)
        return linear(h, layer, proj, cfg, glu=glu), res

    def step(cfg):
        x, res = x0, x0
        for layer in layers:
            qkv, res = normed(x, res, layer, "qkv", cfg["qkv"])
            o = linear(qkv[:, :q], layer, "o", cfg["o"])
            gu, res = normed(o, res, layer, "gate_up", cfg["gate_up"], glu=glu)
            if glu:
                x = linear(gu, layer, "down", cfg["down"])
            else:
                x = (linear(gu, layer, "down", cfg["down"], silu=True) if fuse_silu
                     else linear(silu_and_mul(gu), layer, "down", cfg["down"]))
        h, _ = rmsnorm(x, norm_w, 1e-6, res)
        return linear(h, {"lm_head": head}, "lm_head", cfg["lm_head"])

    shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    if rows > 1:
        def pick(n, k):
            return (SKINNY_BLOCK_N, SKINNY_BLOCK_K, 4, 3, skinny_split(n, k)) if fp8 else None

        def grid(n, k):
            return ([cfg for cfg in CHAIN_SKINNY_GRID if k % (cfg[4] * cfg[1]) == 0] if fp8
                    else [])
    else:
        pick = fp8_gemv_config if fp8 else config_for

        def grid(n, k):
            return [cfg for cfg in CHAIN_GRID
                    if cfg.block_k <= max(1024, triton.next_power_of_2(k))]
    return step, nbytes, {proj: pick(*nk) for proj, nk in shapes.items()}, shapes, grid


def chain_main(argv=None) -> None:
    """``chain``: see the module docstring."""
    from kernels._triton import set_pdl

    ap = argparse.ArgumentParser(description=chain_main.__doc__)
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-0.6B", "dummy:Qwen3-8B:fp8"])
    ap.add_argument("--grid", action="store_true", help="each projection's tile configs in turn")
    ap.add_argument("--projections", nargs="+", default=None,
                    help="the projections --grid tries (default: all, lm_head included)")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows a step (2-8: the few-row kernels, a small batch's decode step or "
                         "a speculating step's verification)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    copy_gbs = ceilings()["copy_GBps"]
    out = []
    for model in args.models:
        step, nbytes, engine_cfg, shapes, grid = _chain(model, args.rows)
        floor_us = nbytes / (copy_gbs * 1e3)  # only reads: the copy rate's bytes a second
        for on in (False, True):
            set_pdl(on)
            us = graph_us(lambda _: step(engine_cfg), [0], reps=50)
            out.append({"model": model, "rows": args.rows, "pdl": on, "configs": "engine",
                        "us": round(us, 1), "floor_us": round(floor_us, 1)})
            print(f"{model} PDL {'on ' if on else 'off'} engine configs: {us:7.1f} us a step "
                  f"({floor_us / us:.0%} of the copy rate)", flush=True)
        if not args.grid:
            continue
        best = dict(engine_cfg)
        for proj in args.projections or list(best):
            k = shapes[proj][1]
            timed = []
            for cfg in grid(*shapes[proj]):
                try:
                    us = graph_us(lambda _: step({**best, proj: cfg}), [0], reps=20)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {proj} {tuple(cfg)}: {type(e).__name__}", flush=True)
                    continue
                timed.append((us, cfg))
            if not timed:  # nothing to choose (bf16 at a few rows: cuBLAS)
                continue
            timed.sort()
            print(f"  {proj} (K {k}): best " + ", ".join(
                f"{tuple(cfg)} {us:.1f}" for us, cfg in timed[:4]), flush=True)
            best[proj] = timed[0][1]
            out.append({"model": model, "rows": args.rows, "pdl": True, "projection": proj,
                        "grid": [[list(cfg), round(us, 1)] for us, cfg in timed]})
        us = graph_us(lambda _: step(best), [0], reps=50)
        configs = {p: c and list(c) for p, c in best.items()}
        print(f"{model} PDL on, best configs {configs}: {us:7.1f} us a step "
              f"({floor_us / us:.0%} of the copy rate)", flush=True)
        out.append({"model": model, "rows": args.rows, "pdl": True, "configs": configs,
                    "us": round(us, 1), "floor_us": round(floor_us, 1)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


TOOLS = {"bf16": bf16_main, "fp8": fp8_main, "quantized": quantized_main, "chain": chain_main}


def main(argv=None) -> None:
    dispatch("projections_bench", TOOLS, argv)


if __name__ == "__main__":
    main()
