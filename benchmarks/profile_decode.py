"""Where one decode step's time goes: host phases timed one by one, the graph's own GPU time,
its kernels (torch profiler over 20 replays), and the top of a cProfile of the engine loop.

    python -m benchmarks.profile_decode --model dummy:Qwen3-0.6B
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:Qwen3-0.6B")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tensor-cores", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--replay-only", action="store_true", help="stop after the graph's GPU time")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = ap.parse_args()
    tc = {"auto": None, "on": True, "off": False}[args.decode_tensor_cores]
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda",
                                    max_num_seqs=max(8, args.batch), decode_tensor_cores=tc,
                                    quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype, show_progress=False))
    params = SamplingParams(temperature=0, max_tokens=args.steps * 3, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([100 + i] * args.prompt_len, params)
    for _ in range(20):
        engine.step()

    graphs, size = engine.runner.graphs, engine.runner.graphs.size_for(args.batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graphs.graphs[size].replay()
    end.record()
    end.synchronize()
    print(f"graph replay (GPU only, size {size}, tensor cores "
          f"{engine.runner.backend.decode_tensor_cores}): {start.elapsed_time(end) / 100:.3f} ms")
    if args.replay_only:
        return

    engine.config.async_scheduling = False  # the phases one after another, timed apart
    engine.step()  # resolves the step still running
    phases = {k: [] for k in ("schedule", "prepare", "plan+replay", "sample+sync", "post")}
    runner, sched = engine.runner, engine.scheduler
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        step = runner.prepare(batch)
        t2 = time.perf_counter()
        logits = graphs.run(step)
        t3 = time.perf_counter()
        due = sched.advance(batch)
        tokens = engine.sampler(logits, due).tokens.tolist()
        t4 = time.perf_counter()
        for seq, tok in zip(due, tokens):
            engine.updater.append(seq, tok)
            engine.updater.output(seq, [tok], None)
        t5 = time.perf_counter()
        for k, a, b in zip(phases, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            phases[k].append((b - a) * 1e3)
    for k, v in phases.items():
        print(f"{k:>12}: {statistics.median(v):.3f} ms")
    for overlap in (False, True):
        engine.config.async_scheduling = overlap
        engine.step()
        t0 = time.perf_counter()
        for _ in range(100):
            engine.step()
        print(f"engine.step, async_scheduling={overlap}: "
              f"{(time.perf_counter() - t0) * 10:.3f} ms/step")

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as kprof:
        for _ in range(20):
            graphs.graphs[size].replay()
        torch.cuda.synchronize()
    print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=20,
                                     max_name_column_width=70))

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        engine.step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue()[-6000:])


if __name__ == "__main__":
    main()
