"""Batch decode attention at Qwen3's GQA ratios (2:1 to 8:1), by kernel: FlashInfer's on CUDA
cores (FA2's decode kernel), on tensor cores through FA2's prefill kernel and through FA3's, and
Baton's one-launch Triton kernel (``kernels.decode_attention``: ``triton`` as the engine launches
it for the row count, the others with a fixed tile, warps and stages), over a bf16 or an FP8
(e4m3) cache.

    python -m benchmarks.attention_bench [--batches 1 16 64] [--contexts 1024 4096] \\
        [--heads 16 32 64] [--graph] [--kv-cache-dtype fp8] [--kernels tc-fa2 triton]

Prints µs per call and the KV bandwidth reached (KV bytes read / time) for each ratio, batch
size and context length, and that bandwidth as a share of the device's read rate, measured in
the same run (a sum over 2 GiB: each byte read once). ``--graph`` runs each kernel as the
engine's decode graphs do: a wrapper over fixed buffers (``use_cuda_graph``), its calls captured
in a CUDA graph and replayed.
"""

from __future__ import annotations

import argparse

import flashinfer
import torch

from benchmarks.lib import cuda_ms, graph_us
from kernels import decode_attention as da

# name -> (use_tensor_cores, backend) of FlashInfer's wrapper, or Baton's kernel's launch
# (tile tokens, warps, stages; None: the engine's for the row count, ``da.launch_config``)
KERNELS = {"cuda-cores": (False, "auto"), "tc-fa2": (True, "fa2"), "tc-fa3": (True, "fa3"),
           "triton": None, "triton-few": (da.TILE_TOKENS, da.NUM_WARPS, da.NUM_STAGES),
           "triton-w4s3": (64, 4, 3), "triton-t128": (128, 8, 2), "triton-t128w4s3": (128, 4, 3)}


def read_GBps() -> float:
    """Bytes read per second by a sum over 2 GiB (the result is a few bytes)."""
    x = torch.ones(2**30, dtype=torch.bfloat16, device="cuda")
    return 2**31 / cuda_ms(lambda: x.sum(dtype=torch.float32), reps=20) / 1e6


def bench(hq: int, hk: int, batch: int, ctx: int, kernel: str, graph: bool, d: int = 128,
          page: int = 16, kv_dtype: torch.dtype = torch.bfloat16) -> float:
    """µs per call of ``kernel`` over ``batch`` rows of ``ctx`` tokens each (pages shuffled)."""
    pages = -(-ctx // page)
    cache = torch.randn(batch * pages + 1, 2, hk, page, d, dtype=torch.bfloat16,
                        device="cuda").to(kv_dtype)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    indices = torch.randperm(batch * pages, dtype=torch.int32) + 1
    last = torch.full((batch,), ctx - (pages - 1) * page, dtype=torch.int32)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scales = {} if kv_dtype == torch.bfloat16 else {"k_scale": 1.0, "v_scale": 1.0}
    if kernel.startswith("triton"):
        buf = torch.zeros(len(indices), dtype=torch.int32, device="cuda")
        w = da.DecodeAttention(batch, buf, hq, hk, d, page, d ** -0.5)
        w.plan(indptr, indices, last)
        w.config = KERNELS[kernel]
    else:
        tensor_cores, backend = KERNELS[kernel]
        ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
        extra = {}
        if graph:
            extra = dict(use_cuda_graph=True,
                         paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32,
                                                            device="cuda"),
                         paged_kv_indices_buffer=torch.zeros(len(indices), dtype=torch.int32,
                                                             device="cuda"),
                         paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32,
                                                                   device="cuda"))
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "HND", use_tensor_cores=tensor_cores, backend=backend, **extra)
        w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16,
               kv_data_type=kv_dtype)
    if graph:
        return graph_us(lambda _: w.run(q, cache, out=out, **scales), [None] * 8)
    return cuda_ms(lambda: w.run(q, cache, out=out, **scales), reps=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64],
                    help="query heads over 8 KV heads (0.6B: 16, 8B: 32, 32B: 64)")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--graph", action="store_true", help="as the engine's decode graphs run it")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    args = ap.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    read = read_GBps()
    print(f"read rate: {read:.0f} GB/s, {args.kv_cache_dtype} cache")
    print("| q:kv heads | batch | context | " + " | ".join(
        f"{k} µs (GB/s, % of read)" for k in args.kernels) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(args.kernels))
    for hq in args.heads:
        for batch in args.batches:
            for ctx in args.contexts:
                kv_bytes = batch * ctx * 2 * 8 * 128 * kv_dtype.itemsize
                cells = []
                for kernel in args.kernels:
                    try:
                        us = bench(hq, 8, batch, ctx, kernel, args.graph, kv_dtype=kv_dtype)
                    except Exception as exc:  # noqa: BLE001 - a kernel this build lacks
                        cells.append(f"failed ({type(exc).__name__})")
                        continue
                    gbs = kv_bytes / us / 1e3
                    cells.append(f"{us:.1f} ({gbs:.0f}, {100 * gbs / read:.0f}%)")
                print(f"| {hq}:8 | {batch} | {ctx} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
