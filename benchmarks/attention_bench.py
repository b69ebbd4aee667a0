"""FlashInfer batch decode at Qwen3's GQA ratios (2:1 to 8:1), by kernel: CUDA cores (FA2's
decode kernel), tensor cores through FA2's prefill kernel, and tensor cores through FA3's.

    python -m benchmarks.attention_bench [--batches 1 16 64] [--contexts 1024 4096] \\
        [--heads 16 32 64] [--graph]

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

# name -> (use_tensor_cores, backend)
KERNELS = {"cuda-cores": (False, "auto"), "tc-fa2": (True, "fa2"), "tc-fa3": (True, "fa3")}


def read_GBps() -> float:
    """Bytes read per second by a sum over 2 GiB (the result is a few bytes)."""
    x = torch.ones(2**30, dtype=torch.bfloat16, device="cuda")
    return 2**31 / cuda_ms(lambda: x.sum(dtype=torch.float32), reps=20) / 1e6


def bench(hq: int, hk: int, batch: int, ctx: int, kernel: str, graph: bool, d: int = 128,
          page: int = 16) -> float:
    """µs per call of ``kernel`` over ``batch`` rows of ``ctx`` tokens each (pages shuffled)."""
    tensor_cores, backend = KERNELS[kernel]
    pages = -(-ctx // page)
    cache = torch.randn(batch * pages + 1, 2, hk, page, d, dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    indices = torch.randperm(batch * pages, dtype=torch.int32) + 1
    last = torch.full((batch,), ctx - (pages - 1) * page, dtype=torch.int32)
    extra = {}
    if graph:
        extra = dict(use_cuda_graph=True,
                     paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32,
                                                        device="cuda"),
                     paged_kv_indices_buffer=torch.zeros(len(indices), dtype=torch.int32,
                                                         device="cuda"),
                     paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32,
                                                               device="cuda"))
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tensor_cores,
                                                      backend=backend, **extra)
    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    if graph:
        return graph_us(lambda _: w.run(q, cache, out=out), [None] * 8)
    return cuda_ms(lambda: w.run(q, cache, out=out), reps=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64],
                    help="query heads over 8 KV heads (0.6B: 16, 8B: 32, 32B: 64)")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--graph", action="store_true", help="as the engine's decode graphs run it")
    args = ap.parse_args()
    read = read_GBps()
    print(f"read rate: {read:.0f} GB/s")
    print("| q:kv heads | batch | context | " + " | ".join(
        f"{k} µs (GB/s, % of read)" for k in args.kernels) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(args.kernels))
    for hq in args.heads:
        for batch in args.batches:
            for ctx in args.contexts:
                kv_bytes = batch * ctx * 2 * 8 * 128 * 2
                cells = []
                for kernel in args.kernels:
                    try:
                        us = bench(hq, 8, batch, ctx, kernel, args.graph)
                    except Exception as exc:  # noqa: BLE001 - a kernel this build lacks
                        cells.append(f"failed ({type(exc).__name__})")
                        continue
                    gbs = kv_bytes / us / 1e3
                    cells.append(f"{us:.1f} ({gbs:.0f}, {100 * gbs / read:.0f}%)")
                print(f"| {hq}:8 | {batch} | {ctx} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
