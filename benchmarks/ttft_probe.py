"""Where an engine's time to first token goes at zero load, outside any server.

The same fresh prompts (no prefix-cache hit) one at a time, timed from "add" to the first
output token:

- ``direct``: ``LLMEngine.add_request`` then ``step()`` on this thread (the offline figure
  ``serving_bench`` subtracts);
- ``thread``: the engine on :class:`AsyncEngine`'s thread, requests posted from a plain thread;
- ``asyncio``: the same driven from an event loop, as a serving replica drives it.

Per variant it prints the median and the wall time of each of the first steps, so a difference
between the variants shows which part of the serving structure costs what.

    python -m benchmarks.ttft_probe --model dummy:Qwen3-0.6B --n 16
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import threading
import time

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def timed_steps(engine: LLMEngine, log: list[tuple[float, float]]) -> None:
    """Record (start, end) of every ``engine.step()``."""
    step = engine.step

    def wrapped():
        t0 = time.perf_counter()
        out = step()
        log.append((t0, time.perf_counter()))
        return out
    engine.step = wrapped


def steps_before(log, t0: float, t1: float) -> str:
    return "/".join(f"{(b - a) * 1e3:.2f}" for a, b in log if t0 <= a < t1)


def direct(engine: LLMEngine, prompts) -> tuple[list[float], list[list[float]]]:
    firsts, steps = [], []
    for p in prompts:
        log: list[float] = []
        t0 = time.perf_counter()
        rid = engine.add_request(p, ONE)
        while True:
            s0 = time.perf_counter()
            outs = engine.step()
            log.append((time.perf_counter() - s0) * 1e3)
            if any(o.request_id == rid and o.new_token_ids for o in outs):
                break
        firsts.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
        steps.append(log)
    return firsts, steps


class Stamps:
    """The engine thread's outputs hook: when each request's first token came out."""

    def __init__(self):
        self.first: dict[str, float] = {}
        self.on_first = lambda rid: None
        self.log: list[tuple[float, float]] = []  # engine steps
        self.steps: list[str] = []

    def __call__(self, outs) -> None:
        for o in outs:
            if o.new_token_ids and o.request_id not in self.first:
                self.first[o.request_id] = time.perf_counter()
                self.on_first(o.request_id)


def threaded(ae: AsyncEngine, stamps: Stamps, prompts, tag: str) -> list[float]:
    got = threading.Event()
    stamps.on_first = lambda rid: got.set()
    firsts = []
    for i, p in enumerate(prompts):
        got.clear()
        rid = f"{tag}{i}"
        t0 = time.perf_counter()
        ae.submit(lambda e, p=p, rid=rid: e.add_request(p, ONE, rid)).result(10)
        assert got.wait(10)
        firsts.append((stamps.first[rid] - t0) * 1e3)
        stamps.steps.append(steps_before(stamps.log, t0, stamps.first[rid]))
        time.sleep(0.02)
    return firsts


def driven_by_asyncio(ae: AsyncEngine, stamps: Stamps, prompts, tag: str) -> list[float]:
    async def main():
        loop = asyncio.get_running_loop()
        waiting: dict[str, asyncio.Future] = {}

        def on_first(rid):  # engine thread
            if (f := waiting.get(rid)) is not None:
                loop.call_soon_threadsafe(f.set_result, None)
        stamps.on_first = on_first
        firsts = []
        for i, p in enumerate(prompts):
            rid = f"{tag}{i}"
            waiting[rid] = loop.create_future()
            t0 = time.perf_counter()
            await ae.call(lambda e, p=p, rid=rid: e.add_request(p, ONE, rid))
            await asyncio.wait_for(waiting[rid], 10)
            firsts.append((stamps.first[rid] - t0) * 1e3)
            stamps.steps.append(steps_before(stamps.log, t0, stamps.first[rid]))
            await asyncio.sleep(0.02)
        return firsts
    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler table of one direct request (CPU self time)")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    gpu = torch.cuda.is_available()
    kw = {"model": args.model, "show_progress": False}
    if gpu:
        kw["gpu_memory_utilization"] = 0.4
    config = EngineConfig(**kw)
    g = torch.Generator().manual_seed(1)
    from engine.model_source import resolve_model
    vocab = min(resolve_model(args.model).config.vocab_size, 150000)

    def fresh(n):
        return torch.randint(10, vocab, (n, args.input_len), generator=g).tolist()

    engine = LLMEngine(config)
    direct(engine, fresh(4))  # warm-up
    firsts, steps = direct(engine, fresh(args.n))
    print(f"direct : median {statistics.median(firsts):6.2f} ms; steps to the first token (ms): "
          + ", ".join("/".join(f"{x:.2f}" for x in s) for s in steps[:4]))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) as prof:
            direct(engine, fresh(1))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    del engine
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    stamps = Stamps()
    ae = AsyncEngine(config, on_outputs=stamps)
    timed_steps(ae.engine, stamps.log)
    try:
        for name, fn in (("thread", threaded), ("asyncio", driven_by_asyncio)):
            fn(ae, stamps, fresh(4), name + "w")
            stamps.steps.clear()
            firsts = fn(ae, stamps, fresh(args.n), name)
            print(f"{name:7s}: median {statistics.median(firsts):6.2f} ms; steps to the first "
                  f"token (ms): " + ", ".join(stamps.steps[:4]))
    finally:
        ae.shutdown()


if __name__ == "__main__":
    main()
