"""Decode projections of Qwen3 shapes, one kernel each: cuBLAS (``F.linear``) against the Triton
skinny matmul (``kernels/gemv.py``) over a grid of tile configs. Each figure is a CUDA graph of
calls over enough copies of the weight to spill L2, so every call streams its weight from HBM.

    python -m benchmarks.gemv_bench --models dummy:Qwen3-0.6B dummy:Qwen3-8B --rows 1 4
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from engine.loader import resolve_model
from kernels.gemv import GemvConfig, gemv

SPILL_BYTES = 400 * 2**20


def projections(model: str) -> dict[str, tuple[int, int]]:
    c = resolve_model(model).config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


def per_call_us(fn, weights, x) -> float:
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 10
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def copy_rate() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * a.numel() * 5 / (start.elapsed_time(end) * 1e-3) / 1e9


CONFIGS = [GemvConfig(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
    (4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["dummy:Qwen3-0.6B", "dummy:Qwen3-8B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gbs = copy_rate()
    print(f"copy rate {gbs:.0f} GB/s")
    rows = []
    print("| model | proj | M | N | K | MB | cuBLAS us | cuBLAS % | Triton us | Triton % | config |")
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
                cublas = per_call_us(F.linear, weights, x)
                best = None
                for cfg in CONFIGS:
                    try:
                        err = ((gemv(x, weights[0], cfg).float() - ref).norm() / ref.norm()).item()
                        us = per_call_us(lambda a, b, c=cfg: gemv(a, b, c), weights, x)
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
