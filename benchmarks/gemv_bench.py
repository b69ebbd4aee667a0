"""Decode projections of Qwen3 shapes, one kernel each: cuBLAS (``F.linear``) against the Triton
skinny matmul (``kernels/gemv.py``) over a grid of tile configs. Each figure is a CUDA graph of
calls over enough copies of the weight to spill L2, so every call streams its weight from HBM.

    python -m benchmarks.gemv_bench --models dummy:Qwen3-0.6B dummy:Qwen3-8B --rows 1 4
    python -m benchmarks.gemv_bench --streaming   # one row: variants of the weight stream

``--streaming`` compares, for one row, the kernel against variants that load the weight with an
evict-first cache hint and bigger K tiles, and prints the read rate of a plain reduction (the
ceiling for a kernel that only reads).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.engine_bench import ceilings, graph_us
from engine.model_source import resolve_model
from kernels._triton import tl, triton
from kernels.gemv import GemvConfig, gemv

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-0.6B", "dummy:Qwen3-8B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default=None)
    ap.add_argument("--streaming", action="store_true",
                    help="one row: variants of the weight stream against the engine's kernel")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
