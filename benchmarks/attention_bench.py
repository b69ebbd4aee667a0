"""FlashInfer batch decode with and without tensor cores at Qwen3's GQA ratios (2:1 to 8:1).

    python -m benchmarks.attention_bench

Prints µs per call and the KV bandwidth reached (KV bytes read / time) for each ratio, batch
size and context length, with ``use_tensor_cores`` off and on; the engine's default follows.
"""

from __future__ import annotations

import argparse

import flashinfer
import torch

from benchmarks.lib import cuda_ms


def bench(hq: int, hk: int, batch: int, ctx: int, tensor_cores: bool, d: int = 128,
          page: int = 16) -> float:
    pages = -(-ctx // page)
    cache = torch.randn(batch * pages + 1, 2, hk, page, d, dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tensor_cores)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    indices = torch.randperm(batch * pages, dtype=torch.int32) + 1
    last = torch.full((batch,), ctx - (pages - 1) * page, dtype=torch.int32)
    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    return cuda_ms(lambda: w.run(q, cache), reps=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    args = ap.parse_args()
    print("| q:kv heads | batch | context | CUDA cores µs | tensor cores µs | faster |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for hq in (16, 32, 64):
        for batch in args.batches:
            for ctx in args.contexts:
                cc, tc = (bench(hq, 8, batch, ctx, t) for t in (False, True))
                print(f"| {hq}:8 | {batch} | {ctx} | {cc:.1f} | {tc:.1f} | "
                      f"{'tensor cores' if tc < cc else 'CUDA cores'} |", flush=True)


if __name__ == "__main__":
    main()
