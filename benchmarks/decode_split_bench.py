"""Decode attention inside CUDA graphs at small batches: FlashInfer's wrapper as the engine uses
it (CUDA cores; under graphs FlashInfer always splits the KV and merges), its tensor-core wrapper
with and without the split (``disable_split_kv``), and the one-launch Triton kernel
(``benchmarks/decode_attention.py``), per layer, over one cache per layer so nothing stays in L2.
Also checks that a no-split graph captured at one context replays right at another.

    python -m benchmarks.decode_split_bench
"""

from __future__ import annotations

import argparse

import flashinfer
import torch

from benchmarks.engine_bench import graph_us

PAGE, D, LAYERS = 16, 128, 36


def _wrapper(ws, batch: int, max_pages: int, tensor_cores: bool):
    def buf(n):
        return torch.zeros(n, dtype=torch.int32, device="cuda")
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=buf(batch + 1), paged_kv_indices_buffer=buf(max_pages),
        paged_kv_last_page_len_buffer=buf(batch))


def _plan(w, batch, ctx, hq, hk, no_split):
    pages = -(-ctx // PAGE)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    indices = torch.arange(1, batch * pages + 1, dtype=torch.int32)
    last = torch.full((batch,), ctx - (pages - 1) * PAGE, dtype=torch.int32)
    kw = {"disable_split_kv": True} if no_split else {}
    w.plan(indptr, indices, last, hq, hk, D, PAGE, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16, **kw)


def per_layer_us(hq, hk, batch, ctx, tensor_cores, no_split, caches, q, ws, max_pages) -> float:
    w = _wrapper(ws, batch, max_pages, tensor_cores)
    _plan(w, batch, ctx, hq, hk, no_split)
    return graph_us(lambda c: w.run(q, c), caches)


def triton_us(hq, hk, batch, ctx, caches, q, max_pages) -> float:
    from benchmarks.decode_attention import DecodeAttention
    pages = -(-ctx // PAGE)
    runner = DecodeAttention(batch, max_pages, hq, hk, D, PAGE, D ** -0.5, q.device)
    runner.plan(torch.arange(0, batch * pages + 1, pages, dtype=torch.int32),
                torch.arange(1, batch * pages + 1, dtype=torch.int32),
                torch.full((batch,), ctx - (pages - 1) * PAGE, dtype=torch.int32))
    return graph_us(lambda c: runner.run(q, c), caches)


def replan_check(hq, hk, batch, caches, q, ws, max_pages, tensor_cores, no_split) -> float:
    """Capture at a 64-token context, re-plan at 1000 and 3000, compare with eager."""
    w = _wrapper(ws, batch, max_pages, tensor_cores)
    _plan(w, batch, 64, hq, hk, no_split)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    w.run(q, caches[0])
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out.copy_(w.run(q, caches[0]))
    worst = 0.0
    for ctx in (1000, 3000):
        _plan(w, batch, ctx, hq, hk, no_split)
        graph.replay()
        eager = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
        _plan(eager, batch, ctx, hq, hk, False)
        ref = eager.run(q, caches[0])
        worst = max(worst, ((out.float() - ref.float()).norm() / ref.float().norm()).item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    args = ap.parse_args()
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    hk = 8
    print("| q:kv heads | batch | context | split (engine) µs | tensor cores, split µs | "
          "tensor cores, no split µs | Triton, one launch µs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        max_pages = batch * -(-max(args.contexts + [3000]) // PAGE)
        caches = [torch.randn(max_pages + 1, 2, hk, PAGE, D, dtype=torch.bfloat16, device="cuda")
                  for _ in range(LAYERS)]
        for hq in (16, 32):
            q = torch.randn(batch, hq, D, dtype=torch.bfloat16, device="cuda")
            for ctx in args.contexts:
                row = [per_layer_us(hq, hk, batch, ctx, tc, ns, caches, q, ws, max_pages)
                       for tc, ns in ((False, False), (True, False), (True, True))]
                row.append(triton_us(hq, hk, batch, ctx, caches, q, max_pages))
                print(f"| {hq}:{hk} | {batch} | {ctx} | " + " | ".join(f"{v:.1f}" for v in row)
                      + " |", flush=True)
            err = replan_check(hq, hk, batch, caches, q, ws, max_pages, True, True)
            print(f"re-planned no-split graph vs eager, {hq}:{hk} batch {batch}: "
                  f"relative error {err:.1e}", flush=True)
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
