"""Where one prefill step's time goes: the step's wall time, and its CUDA kernels (torch
profiler over a few prompts) summed by kind: GEMMs, FP8 activation quantization, attention,
norms, the rest.

    python -m benchmarks.profile_prefill --model dummy:Qwen3-8B --lengths 1024 2048 \
        [--quantization fp8] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

KINDS = (  # first match wins, on the lower-cased kernel name
    ("fp8 activation quantization", ("quantize_rows",)),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "_block_mm", "matmul", "scaled_mm")),
    ("attention", ("prefill", "flash", "attention", "batchprefill")),
    ("norm", ("norm",)),
    ("rope / kv store", ("rope", "store_kv", "append")),
    ("activation", ("silu", "act_and_mul", "gelu")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def run_prompt(engine: LLMEngine, n: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, engine.vocab_size - 100, (n,), generator=gen).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:Qwen3-8B")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cprofile", action="store_true",
                    help="also the host's top functions over the reps of the first length")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", max_num_seqs=4,
                                    max_num_batched_tokens=max(args.lengths),
                                    enable_prefix_caching=False, quantization=args.quantization,
                                    show_progress=False))
    for n in args.lengths:
        for rep in range(2):  # compile and tune for this shape
            run_prompt(engine, n, rep)
        walls = [run_prompt(engine, n, 10 + rep) for rep in range(args.reps)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for rep in range(args.reps):
                run_prompt(engine, n, 20 + rep)
        by_kind, by_kernel = defaultdict(float), defaultdict(float)
        for ev in prof.key_averages():
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            if us <= 0:
                continue
            by_kind[kind_of(ev.key)] += us / args.reps / 1e3
            by_kernel[ev.key] += us / args.reps / 1e3
        top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
        print(json.dumps({"model": args.model, "weights": engine.weights_name, "tokens": n,
                          "wall_ms": round(statistics.median(walls) * 1e3, 2),
                          "gpu_ms": round(sum(by_kind.values()), 2),
                          "by_kind_ms": {k: round(v, 2) for k, v in
                                         sorted(by_kind.items(), key=lambda kv: -kv[1])},
                          "top_kernels_ms": [[k[:90], round(v, 3)] for k, v in top]}))
        if args.cprofile and n == args.lengths[0]:
            prof_host = cProfile.Profile()
            prof_host.enable()
            for rep in range(args.reps):
                run_prompt(engine, n, 30 + rep)
            prof_host.disable()
            text = io.StringIO()
            pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(18)
            print(text.getvalue())


if __name__ == "__main__":
    main()
