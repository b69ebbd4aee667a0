"""Where the engine's time goes, one tool:
``python -m benchmarks.profiler {decode|prefill|host|ttft} [options]``.

``decode``: one decode step: host phases timed one by one, the graph's own GPU time, the
pieces of the engine loop as it runs (one step ahead) timed in place, its kernels (torch
profiler over 20 replays), and the top of a cProfile of the engine loop.

    python -m benchmarks.profiler decode --model dummy:Qwen3-0.6B

``prefill``: one prefill step: the step's wall time, and its CUDA kernels (torch
profiler over a few prompts) summed by kind: GEMMs, FP8 activation quantization, attention,
norms, the rest.

    python -m benchmarks.profiler prefill --model dummy:Qwen3-8B --lengths 1024 2048 \\
        [--quantization fp8] [--cprofile] [--timeline]

With ``--timeline``, also where one prompt's steps leave the device idle: its trace with the
engine's pieces marked (schedule, inputs, attention plan, forward, logits, ...), then the same
unprofiled with a CUDA event at each piece's start and end (the device's clock).

``host``: The engine's host work per decode step, with the model taken out: what the CPU spends on
scheduling, building a step's inputs, sampling bookkeeping and outputs while the GPU would be
idle when they run one after another (``async_scheduling=False``; the engine's default overlaps
them with the previous step's device work).

    python -m benchmarks.profiler host --batch 1 64 256

Runs on CPU with the ``tiny`` model's engine; the forward pass is replaced by fixed logits, so
every figure is host time. Absolute numbers depend on the CPU; compare runs on one machine.

``timeline``: the GPU's timeline over a few engine steps of ``--batch`` sequences decoding (one
by default; ``--prompt-len`` tokens of prompt each), from the torch profiler's trace: wall time
a step, the GPU's busy time and its idle gaps, the largest gaps by the operations on either
side (where the device waits for the host), and the device time by kernel. With
``--speculative-config`` (vLLM's JSON) and ``--kept`` (the share of proposals kept, forced as
``engine_bench``'s timing points do), a step is a speculating one.

    python -m benchmarks.profiler timeline --model dummy:Qwen3-8B --quantization fp8 \
        [--fp8-lm-head] [--speculative-config '{"method": "draft_model",
        "model": "dummy:Qwen3-0.6B", "num_speculative_tokens": 4}' --kept 70]

``attention``: the decode graph's device time at several contexts and row counts with
FlashInfer's decode attention and with the few-row kernel (``kernels.decode_attention``), and
with ``--grid`` over that kernel's tile configs and ``--targets`` over the programs a launch
aims at (how its constants were chosen; GPU only). Its graphs replay the kernel at every
context given, also past the length where the engine hands long steps to FlashInfer.

    python -m benchmarks.profiler attention --model dummy:Qwen3-0.6B --grid --targets 256 512

``ablate``: an upper bound on what folding a kind of small kernel away could save: runs
``engine_bench`` (its arguments follow ``--`` ) with those launches removed from the model
(``norm``: the RMSNorms, ``silu``: the SiLU-and-multiply, also where a one-row gate/up
projection would end in it, ``qk``: the q/k norm + RoPE + K/V store; each replaced by a view of
its input). The tokens are meaningless; the step time is
that of the graph without those kernels.

    python -m benchmarks.profiler ablate --without norm -- --tasks ceilings decode \
        --decode-models dummy:Qwen3-8B --quantization fp8

``steady``: a steady decode step of ``--batch`` rows (256 by default) after ``--prompt-len``
tokens of prompt each: the engine's wall time a step, the device's kernel time by kind, and
the step's memory floor; a wall over the kernel time is the device waiting for the host.

    python -m benchmarks.profiler steady --model dummy:Qwen3-8B --batch 256 --prompt-len 700

``ttft``: an engine's time to first token at zero load, outside any server.

The same fresh prompts (no prefix-cache hit) one at a time, timed from "add" to the first
output token:

- ``direct``: ``LLMEngine.add_request`` then ``step()`` on this thread, back to back (the
  offline figure ``serving_bench`` subtracts), then again 20 ms apart, as the others run;
- ``thread``: the engine on :class:`AsyncEngine`'s thread, requests posted from a plain thread;
- ``asyncio``: the same driven from an event loop, as a serving replica drives it.

Per variant it prints the median and the wall time of each of the first steps, so a difference
between the variants shows which part of the serving structure costs what.

    python -m benchmarks.profiler ttft --model dummy:Qwen3-0.6B --n 16

With ``--busy AT:MS`` (several allowed) the asyncio variant is run again with the event loop
busy in pure Python for ``MS`` ms from ``AT`` ms after each request is posted, as a replica's
loop is while Serve hands it a call (the call's Python and the engine's step share the
process's one GIL), at each of ``--switch-intervals`` (seconds, Python's GIL switch interval).

    python -m benchmarks.profiler ttft --model dummy:Qwen3-0.6B --busy 0.3:1.0 1.0:1.0 \
        --switch-intervals 0.005 0.0002

With ``--gaps KIND:MS`` (several allowed) direct requests run again, the variants taking turns
one request each, each request after ``MS`` ms of ``sleep`` (host and GPU idle), ``spin`` (the
host's thread busy in Python), ``gpu`` (the host asleep, one SM busy on a side stream) or
``both``: what an idle gap before a request costs, and whether keeping either side busy takes it
back. ``--profile-gap MS`` then prints the host operations that grow after such a gap (the
torch profiler's CPU time a request, back to back against ``MS`` ms apart, twice each);
``--gaps-only`` stops there.

    python -m benchmarks.profiler ttft --model dummy:Qwen3-0.6B --n 24 \
        --gaps sleep:0 sleep:20 spin:20 gpu:20 both:20 --gaps-only --profile-gap 20

"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib import TENSOR_CORES, dispatch
from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine


# -- decode --------------------------------------------------------------------------------
def decode_main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:Qwen3-0.6B")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tensor-cores", choices=list(TENSOR_CORES), default="auto")
    ap.add_argument("--replay-only", action="store_true", help="stop after the graph's GPU time")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = ap.parse_args(argv)
    tc = TENSOR_CORES[args.decode_tensor_cores]
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
    print("the pieces of engine.step (async_scheduling=True), host µs a step:")
    for label, (us, calls) in timed_pieces(engine, 200).items():
        print(f"{label:>22}: {us:8.1f}  ({calls:.2f} calls a step)")

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


def timed_pieces(engine: LLMEngine, steps: int,
                 outputs: list | None = None) -> dict[str, tuple[float, float]]:
    """Host µs a step spent in each piece of ``engine.step()`` (and calls a step), the engine
    running as configured (one step ahead by default): each piece is wrapped in a timer for
    ``steps`` steps (their outputs appended to ``outputs``), then put back. Where the host
    waits on the device it shows here (the wait for a step's tokens, or a launch that blocks),
    which the phases timed apart cannot show."""
    from engine.model_runner import StepInputs
    from engine.sampler import Sampler
    from engine.step_update import LaunchedStep

    runner = engine.runner
    pieces = [(engine, "step", "engine.step"), (engine.scheduler, "schedule", "schedule"),
              (engine, "_launch", "launch"), (runner, "prepare", "prepare inputs"),
              (StepInputs, "feed_pending", "pending-token gather"),
              (Sampler, "__call__", "sample"), (engine, "_to_host", "copies to the host"),
              (engine.scheduler, "advance", "advance"), (engine.updater, "resolve", "resolve"),
              (LaunchedStep, "wait", "wait for the tokens")]
    if runner.graphs is not None:
        pieces += [(runner.graphs, "run", "graph step"),
                   (runner.backend, "plan_decode", "attention plan"),
                   (torch.cuda.CUDAGraph, "replay", "graph launch")]
    spent, calls = defaultdict(float), defaultdict(int)

    def timer(fn, label):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1
        return timed

    with wrapped(pieces, timer):
        for _ in range(steps):
            made = engine.step()
            if outputs is not None:
                outputs += made
    return {label: (spent[label] / steps * 1e6, calls[label] / steps)
            for _, _, label in pieces if calls[label]}


_MISSING = object()


@contextlib.contextmanager
def wrapped(pieces, wrap):
    """Each ``(obj, name, label)`` of ``pieces`` replaced by ``wrap(obj.name, label)`` while in
    the block, then put back."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in pieces]
    for obj, name, label in pieces:
        setattr(obj, name, wrap(getattr(obj, name), label))
    try:
        yield
    finally:
        for obj, name, before in reversed(saved):
            if before is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


# -- prefill -------------------------------------------------------------------------------
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

def prefill_main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:Qwen3-8B")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cprofile", action="store_true",
                    help="also the host's top functions over the reps of the first length")
    ap.add_argument("--timeline", action="store_true",
                    help="also where one prompt's step leaves the GPU idle, and what the host "
                         "does meanwhile")
    args = ap.parse_args(argv)
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
        if args.timeline:
            prefill_timeline(engine, n, seed=40)
        if args.cprofile and n == args.lengths[0]:
            prof_host = cProfile.Profile()
            prof_host.enable()
            for rep in range(args.reps):
                run_prompt(engine, n, 30 + rep)
            prof_host.disable()
            text = io.StringIO()
            pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(18)
            print(text.getvalue())


def prefill_timeline(engine: LLMEngine, n: int, seed: int) -> None:
    """One ``n``-token prompt's steps under the torch profiler, the engine's pieces marked:
    when the GPU starts and stops against the steps' wall, its idle gaps, and each piece's
    place and length on the host's timeline (µs from the first step's start)."""
    import tempfile

    from torch.profiler import record_function

    from engine.model_runner import StepInputs
    from engine.sampler import Sampler
    from engine.step_update import LaunchedStep
    runner = engine.runner
    pieces = [(engine, "step", "engine.step"), (engine.scheduler, "schedule", "schedule"),
              (runner, "prepare", "prepare inputs"), (StepInputs, "host_rows", "input rows"),
              (runner.backend, "plan", "attention plan"), (runner.model, "forward", "forward"),
              (runner.model, "compute_logits", "logits"), (Sampler, "__call__", "sample"),
              (engine, "_to_host", "copies to the host"), (LaunchedStep, "wait", "wait"),
              (engine.updater, "resolve", "resolve")]
    if runner.mixed is not None:
        pieces.append((runner.mixed, "run", "piecewise graphs"))

    def marked(fn, label):
        def run(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return run

    run_prompt(engine, n, seed)  # the same path once, unprofiled
    with wrapped(pieces, marked), profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_prompt(engine, n, seed + 1)  # the profiler's own first calls cost more: not read
        with record_function("prompt"):
            run_prompt(engine, n, seed + 2)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    labels = {label for _, _, label in pieces}
    ann = [e for e in events if e.get("cat") == "user_annotation" and "dur" in e]
    (a0, a1), = [(e["ts"], e["ts"] + e["dur"]) for e in ann if e["name"] == "prompt"]
    marks = sorted((e for e in ann if e["name"] in labels and a0 <= e["ts"] <= a1),
                   key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                  and "dur" in e and a0 <= e["ts"] <= a1 + 1e6), key=lambda e: e["ts"])
    if not marks or not gpu:
        raise SystemExit("no marked step or no GPU operation in the trace")
    steps = [e for e in marks if e["name"] == "engine.step"]
    t0, t1 = steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps)
    g0, g1 = gpu[0]["ts"], gpu[-1]["ts"] + gpu[-1]["dur"]
    busy = sum(e["dur"] for e in gpu)
    gaps = [(b["ts"] - a["ts"] - a["dur"], a, b) for a, b in zip(gpu, gpu[1:])]
    inner = sum(max(g, 0.0) for g, _, _ in gaps)
    print(f"timeline {n} tokens (under the profiler): steps {(t1 - t0) / 1e3:.2f} ms, GPU busy "
          f"{busy / 1e3:.2f} ms; idle before its first operation {(g0 - t0) / 1e3:.2f} ms, "
          f"between operations {inner / 1e3:.2f} ms, after its last {(t1 - g1) / 1e3:.2f} ms; "
          f"{len(gpu)} GPU operations")
    for g, a, b in sorted(gaps, key=lambda x: -x[0])[:8]:
        print(f"  gap {g:8.1f} us at {a['ts'] + a['dur'] - t0:9.1f}: {a['name'][:50]} -> "
              f"{b['name'][:50]}")
    print("  host pieces (start .. end, µs from the first step's start):")
    for e in marks:
        print(f"    {e['ts'] - t0:9.1f} .. {e['ts'] + e['dur'] - t0:9.1f}  {e['name']}")
    print(f"    GPU {g0 - t0:9.1f} .. {g1 - t0:9.1f}")
    # Again without the profiler (whose own host work widens the gaps): a CUDA event at each
    # piece's start and end, on the step's stream. On an idle device an event completes as the
    # host records it; behind queued work, when the work before it is done.
    stamps = []

    def evented(fn, label):
        def run(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                stamps.append((label, start, end))
        return run

    with wrapped(pieces, evented):
        wall = run_prompt(engine, n, seed + 3)
    first = min((s for _, s, _ in stamps), key=lambda e: stamps[0][1].elapsed_time(e))
    print(f"  without the profiler: wall {wall * 1e3:.2f} ms; pieces on the device's clock "
          f"(start .. end, µs from the first step's start; an end is when the device got there):")
    for label, start, end in sorted(stamps, key=lambda x: first.elapsed_time(x[1])):
        print(f"    {first.elapsed_time(start) * 1e3:9.1f} .. {first.elapsed_time(end) * 1e3:9.1f}"
              f"  {label}")


# -- host ----------------------------------------------------------------------------------
PHASES = ("schedule", "prepare", "advance", "sample", "stop checks", "outputs")

def measure(batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=8192,
                                    max_num_seqs=max(batch, 1), show_progress=False,
                                    async_scheduling=False))
    logits = torch.zeros(batch, engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request([5 + i % 100] * prompt_len, params)
    engine.runner.execute = lambda b, prev=None, draws=None: logits[: len(b.seqs)]
    for _ in range(5):  # prefill and a few decode steps
        engine.step()
    totals = dict.fromkeys(PHASES, 0.0)
    for _ in range(steps):
        t = [time.perf_counter()]
        batch_ = engine.scheduler.schedule()
        t.append(time.perf_counter())
        engine.runner.prepare(batch_)
        t.append(time.perf_counter())
        due = engine.scheduler.advance(batch_)
        t.append(time.perf_counter())
        tokens = engine.sampler(logits[: len(due)], due).tokens.tolist()
        t.append(time.perf_counter())
        for seq, token in zip(due, tokens):
            engine.updater.append(seq, token)
        t.append(time.perf_counter())
        for seq, token in zip(due, tokens):
            engine.updater.output(seq, [token], None)
        t.append(time.perf_counter())
        for name, a, b in zip(PHASES, t, t[1:]):
            totals[name] += b - a
    return {name: v / steps * 1e3 for name, v in totals.items()}

def host_main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=300)
    args = ap.parse_args(argv)
    print("| batch | " + " | ".join(PHASES) + " | total ms/step |")
    print("| ---: |" + " ---: |" * (len(PHASES) + 1))
    for b in args.batch:
        ms = measure(b, args.steps, args.prompt_len)
        print(f"| {b} | " + " | ".join(f"{ms[p]:.3f}" for p in PHASES)
              + f" | {sum(ms.values()):.3f} |", flush=True)


# -- ttft ----------------------------------------------------------------------------------
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

def idle(kind: str, gap_s: float) -> None:
    """The gap before a request: ``sleep`` (the host and the GPU idle), ``spin`` (the host's
    thread busy in Python, the GPU idle), ``gpu`` (the host asleep, one SM kept busy on a
    side stream until the request comes) or ``both``."""
    if kind in ("gpu", "both") and gap_s > 0 and torch.cuda.is_available():
        global _SIDE
        if _SIDE is None:
            _SIDE = torch.cuda.Stream()
        with torch.cuda.stream(_SIDE):  # cycles at 1.98 GHz for 80% of the gap
            torch.cuda._sleep(int(gap_s * 0.8 * 1.98e9))
    if kind in ("spin", "both"):
        burn(gap_s * 1e3)
        return
    time.sleep(gap_s)

_SIDE = None

def direct(engine: LLMEngine, prompts, gap_s: float = 0.0, kind: str = "sleep"
           ) -> tuple[list[float], list[list[float]]]:
    firsts, steps = [], []
    for p in prompts:
        idle(kind, gap_s)
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

def burn(ms: float) -> None:
    """Pure Python for ``ms`` ms: the GIL is given up only when another thread asks for it and
    the switch interval has passed."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def driven_by_asyncio(ae: AsyncEngine, stamps: Stamps, prompts, tag: str,
                      busy: tuple[float, float] | None = None) -> list[float]:
    """Requests posted from an event loop, each awaited to its first token. With ``busy``
    (``(at_ms, ms)``) each is posted without waiting for the add (as ``AsyncEngine.run``
    does) and the loop is busy in Python for ``ms`` ms from ``at_ms`` after the post."""
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
            add = ae.submit(lambda e, p=p, rid=rid: e.add_request(p, ONE, rid))
            if busy is None:
                await asyncio.wrap_future(add)
            elif busy[1]:
                loop.call_later(busy[0] / 1e3, burn, busy[1])
            await asyncio.wait_for(waiting[rid], 10)
            firsts.append((stamps.first[rid] - t0) * 1e3)
            stamps.steps.append(steps_before(stamps.log, t0, stamps.first[rid]))
            await asyncio.sleep(0.02)
        return firsts
    return asyncio.run(main())


def profile_gap(engine: LLMEngine, fresh, ms: float, n: int = 12) -> None:
    """Which host operations of a request's steps grow after an idle gap: each operation's CPU
    time a request, back to back against ``ms`` ms apart, largest growth first."""
    from torch.profiler import ProfilerActivity, profile
    per = []
    for gap_s in (0.0, ms / 1e3, 0.0, ms / 1e3):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            direct(engine, fresh(n), gap_s=gap_s)
        per.append({e.key: (e.self_cpu_time_total / n, e.count / n)
                    for e in prof.key_averages()})
    keys = set().union(*per)

    def us(i, k):
        return per[i].get(k, (0.0, 0))[0]
    grow = sorted(keys, key=lambda k: -(us(1, k) + us(3, k) - us(0, k) - us(2, k)))
    total = [sum(v[0] for v in d.values()) for d in per]
    print(f"host time a request (us), back to back / {ms:g} ms apart, twice: "
          + " / ".join(f"{t:.0f}" for t in total))
    for k in grow[:14]:
        print(f"  {k[:48]:48s} " + " ".join(f"{us(i, k):8.1f}" for i in range(4))
              + f"  x{per[0].get(k, (0, 0))[1]:.0f}")


def ttft_main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--busy", nargs="*", default=[], metavar="AT:MS",
                   help="the asyncio variant again, its loop busy MS ms from AT ms after a post")
    p.add_argument("--switch-intervals", type=float, nargs="*", default=[],
                   help="GIL switch intervals (s) the busy variants run at (default: as set)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler table of one direct request (CPU self time)")
    p.add_argument("--gaps", nargs="*", default=[], metavar="KIND:MS",
                   help="direct requests again, each after MS ms of KIND: sleep (host and GPU "
                        "idle), spin (the host busy in Python), gpu (one SM busy) or both")
    p.add_argument("--gaps-only", action="store_true",
                   help="stop after the --gaps variants (and --profile-gap)")
    p.add_argument("--profile-gap", type=float, default=0.0, metavar="MS",
                   help="the host's operations of requests back to back against MS ms apart")
    args = p.parse_args(argv)
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
    # The served requests of a zero-load run come apart, as the other variants' do (20 ms).
    firsts, steps = direct(engine, fresh(args.n), gap_s=0.02)
    print(f"direct, 20 ms apart: median {statistics.median(firsts):6.2f} ms; steps (ms): "
          + ", ".join("/".join(f"{x:.2f}" for x in s) for s in steps[:4]))
    # The gap variants take turns, one request each, so that the host's drift is shared.
    got = {gap: ([], []) for gap in args.gaps}
    for _ in range(args.n if args.gaps else 0):
        for gap in args.gaps:
            kind, ms = gap.split(":")
            firsts, steps = direct(engine, fresh(1), gap_s=float(ms) / 1e3, kind=kind)
            got[gap][0].extend(firsts)
            got[gap][1].extend(steps)
    for gap, (firsts, steps) in got.items():
        print(f"direct, {gap:9s} before: median {statistics.median(firsts):6.2f} ms "
              f"(p25 {statistics.quantiles(firsts, n=4)[0]:5.2f}), first step "
              f"{statistics.median(s[0] for s in steps):5.2f}, the rest "
              f"{statistics.median(sum(s[1:]) for s in steps):5.2f} ms", flush=True)
    if args.profile_gap:
        profile_gap(engine, fresh, args.profile_gap)
    if args.gaps_only:
        return
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
        for interval in args.switch_intervals or [sys.getswitchinterval()]:
            sys.setswitchinterval(interval)
            for busy in ["0:0"] + args.busy:
                at_ms, ms = (float(x) for x in busy.split(":"))
                stamps.steps.clear()
                firsts = driven_by_asyncio(ae, stamps, fresh(args.n), f"b{interval}{busy}",
                                           (at_ms, ms))
                print(f"posted, loop busy {ms:.1f} ms from {at_ms:.1f} ms, switch interval "
                      f"{interval * 1e3:.2f} ms: median {statistics.median(firsts):6.2f} ms, "
                      f"max {max(firsts):6.2f}; steps (ms): " + ", ".join(stamps.steps[:3]))
    finally:
        ae.shutdown()


# -- timeline ------------------------------------------------------------------------------
def timeline_main(argv=None) -> None:
    import tempfile
    from collections import Counter

    from benchmarks.engine_bench import _engine, _forcing, _prompt, _warm
    ap = argparse.ArgumentParser(prog="profiler timeline")
    ap.add_argument("--model", default="dummy:Qwen3-0.6B")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    ap.add_argument("--kept", type=int, default=None,
                    help="with --speculative-config: percent of the proposals kept (forced)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warm-steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding at once")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--fp8-lm-head", action="store_true", help="the engine's fp8_lm_head")
    args = ap.parse_args(argv)
    kw = {"quantization": args.quantization} if args.quantization else {}
    if args.fp8_lm_head:
        kw["fp8_lm_head"] = True
    if args.speculative_config:
        kw["speculative_config"] = args.speculative_config
    engine = _engine(args.model, max_num_seqs=max(8, args.batch), **kw)
    _warm(engine)
    if args.speculative_config:
        import engine.llm_engine as llm_engine
        from engine.spec_decode import SpecController
        if args.kept is not None:
            llm_engine.verify = _forcing(args.kept)
        engine.spec = SpecController()
    per_step = 1 + (args.speculative_config or {}).get("num_speculative_tokens", 0)
    new = (args.warm_steps + args.steps) * per_step + 8  # still decoding when the trace ends
    for i in range(args.batch):
        engine.add_request(_prompt(engine, args.prompt_len, 7 + i),
                           SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    for _ in range(args.warm_steps):
        engine.step()
    torch.cuda.synchronize()
    n = args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                  and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        raise SystemExit("no GPU operation in the trace")
    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    print(f"{args.model} {kw}: wall {wall / n * 1e3:.3f} ms a step (under the profiler); GPU "
          f"span {span / n / 1e3:.3f}, busy {busy / n / 1e3:.3f} ms a step; "
          f"{len(gpu) / n:.0f} GPU operations a step")
    gaps, count = Counter(), Counter()
    for a, b in zip(gpu, gpu[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 5:
            gaps[a["name"][:60], b["name"][:60]] += g
            count[a["name"][:60], b["name"][:60]] += 1
    idle = sum(max(0.0, b["ts"] - a["ts"] - a["dur"]) for a, b in zip(gpu, gpu[1:]))
    print(f"idle gaps: {idle / n:.1f} us a step; over 5 us, by the operations around them:")
    for (a, b), g in gaps.most_common(12):
        print(f"  {g / n:8.1f} us a step  x{count[a, b] / n:.1f}  {a} -> {b}")
    by, calls = Counter(), Counter()
    for e in gpu:
        by[e["name"][:70]] += e["dur"]
        calls[e["name"][:70]] += 1
    print("device time by operation (us a step, calls a step):")
    for name, t in by.most_common(20):
        print(f"  {t / n:8.1f}  {calls[name] / n:5.1f}  {name}")


# -- attention -----------------------------------------------------------------------------
def attention_main(argv=None) -> None:
    """The decode graph's device time (ms a replay) at each context length and row count, with
    FlashInfer's decode attention and with the few-row kernel (``kernels.decode_attention``),
    and with ``--grid`` each of that kernel's tile configs: the run that chose its constants."""
    import itertools

    import kernels.decode_attention as da
    from benchmarks.engine_bench import _engine
    from benchmarks.lib import cuda_ms
    from engine.cuda_graph import DecodeGraphs

    ap = argparse.ArgumentParser(prog="profiler attention")
    ap.add_argument("--model", default="dummy:Qwen3-0.6B")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, da.MAX_ROWS])
    ap.add_argument("--grid", action="store_true",
                    help="also tiles of 32/64/128 tokens, chunks of 128/256/512, 4/8 warps")
    ap.add_argument("--targets", type=int, nargs="+", default=[da.TARGET_PROGRAMS],
                    help="programs a launch aims at (the KV splits: TARGET_PROGRAMS), each tried")
    args = ap.parse_args(argv)
    engine = _engine(args.model, quantization=args.quantization, max_num_seqs=max(args.rows))
    runner, backend = engine.runner, engine.runner.backend

    def replays(label: str, small_rows: int) -> None:
        backend.small_decode_rows = small_rows
        runner.graphs.release()
        runner.graphs = DecodeGraphs(runner, max(args.rows))  # wrappers of this choice
        runner.graphs.capture(progress=False)
        out = {}
        for ctx, rows in itertools.product(args.contexts, args.rows):
            for i in range(rows):  # leaves the graph of `rows` planned over these contexts
                engine.add_request([100 + i + j % 50 for j in range(ctx)],
                                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
            graph = runner.graphs.graphs[runner.graphs.size_for(rows)]
            out[f"{ctx}x{rows}"] = round(cuda_ms(graph.replay, reps=100), 4)
        print(label, json.dumps(out), flush=True)

    replays("flashinfer", 0)
    configs = [(da.TILE_TOKENS, da.TILE_TOKENS * da.MIN_CHUNK_TILES, da.NUM_WARPS)]
    if args.grid:
        configs += [c for c in itertools.product((32, 64, 128), (128, 256, 512), (4, 8))
                    if c[1] >= c[0] and c not in configs]
    for (tile, chunk, warps), target in itertools.product(configs, args.targets):
        da.TILE_TOKENS, da.MIN_CHUNK_TILES, da.NUM_WARPS = tile, chunk // tile, warps
        da.TARGET_PROGRAMS = target
        replays(f"few-row kernel, tile {tile}, chunk >= {chunk}, {warps} warps, {target} "
                f"programs", da.MAX_ROWS)


# -- ablate ---------------------------------------------------------------------------------
def ablate_main(argv=None) -> None:
    import benchmarks.engine_bench as engine_bench
    from engine.models import layers, qwen3

    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="profiler ablate")
    ap.add_argument("--without", nargs="+", choices=["norm", "silu", "qk"], required=True)
    args = ap.parse_args(argv[:cut])
    if "norm" in args.without:
        layers.RMSNorm.forward = lambda self, x, residual=None, residual_out=None: (
            x if residual is None else (x, residual))
    if "silu" in args.without:  # (one-row gate/up projections then end without it too)
        qwen3.GLU_EPILOGUE = False
        qwen3.silu_and_mul = lambda gate_up: gate_up[:, : gate_up.shape[1] // 2]
    if "qk" in args.without:
        qwen3.Qwen3Attention.queries = lambda self, positions, qkv, out=None: qkv[
            :, : self.q_size].view(-1, self.num_heads, self.head_dim)
    print(f"without: {sorted(args.without)} (tokens meaningless; step times are the point)",
          flush=True)
    sys.argv = ["engine_bench", *argv[cut + 1:]]
    engine_bench.main()


# -- steady ------------------------------------------------------------------------------
def steady_main(argv=None) -> None:
    """A steady decode step of many rows: the engine's wall time a step against the device's
    kernel time (the difference is where the device waits for the host), by kind, and the
    step's memory floor (weights and the rows' KV read once at the copy rate)."""
    from benchmarks.engine_bench import _engine, _prompt, model_bytes
    from benchmarks.lib import ceilings

    ap = argparse.ArgumentParser(prog="profiler steady")
    ap.add_argument("--model", default="dummy:Qwen3-0.6B")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=700)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--decode-tensor-cores", choices=list(TENSOR_CORES), default="auto")
    args = ap.parse_args(argv)
    copy_gbs = ceilings()["copy_GBps"]
    engine = _engine(args.model, max_num_seqs=args.batch, quantization=args.quantization,
                     kv_cache_dtype=args.kv_cache_dtype,
                     decode_tensor_cores=TENSOR_CORES[args.decode_tensor_cores])
    for i in range(args.batch):
        engine.add_request(_prompt(engine, args.prompt_len, i),
                           SamplingParams(temperature=0, max_tokens=4 * args.steps + 200,
                                          ignore_eos=True))
    while any(s.num_computed_tokens < args.prompt_len for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # every prompt prefilled
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    rows = len(engine.scheduler.running)
    context = sum(s.num_computed_tokens for s in engine.scheduler.running)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    by_kind = defaultdict(float)
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            by_kind[kind_of(ev.key)] += ev.device_time_total / args.steps / 1e3
    weights, kv_tok = model_bytes(engine)
    kv = kv_tok * (context + 1.5 * args.steps * rows)  # the profiled steps' mean context
    print(json.dumps({"model": args.model, "weights": engine.weights_name, "rows": rows,
                      "mean_context": round(context / max(rows, 1) + 1.5 * args.steps),
                      "wall_ms": round(wall, 3), "gpu_ms": round(sum(by_kind.values()), 3),
                      "floor_ms": round((weights + kv) / copy_gbs / 1e6, 3),
                      "by_kind_ms": {k: round(v, 3) for k, v in
                                     sorted(by_kind.items(), key=lambda kv: -kv[1])}}))


TOOLS = {"decode": decode_main, "steady": steady_main, "prefill": prefill_main,
         "host": host_main, "ttft": ttft_main,
         "timeline": timeline_main, "attention": attention_main, "ablate": ablate_main}


def main(argv=None) -> None:
    dispatch("profiler", TOOLS, argv)


if __name__ == "__main__":
    main()
