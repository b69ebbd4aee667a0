"""The planner: how many prefill and decode replicas, at what tensor-parallel size, give the most
goodput per GPU for a workload and its latency targets (DistServe's method: a simulation of each
layout from a profile measured on the GPU, ``loadtests.simulate``).

    # on the GPU host: the profile of each tensor-parallel size to consider
    python -m loadtests.plan profile --model dummy:Qwen3-8B --out results/profile-8b-tp1.json
    python -m loadtests.plan profile --model dummy:Qwen3-8B --tensor-parallel-size 2 \\
        --out results/profile-8b-tp2.json
    # anywhere: the best layouts for a cluster of 8 GPUs
    python -m loadtests.plan plan --profile results/profile-8b-tp1.json \\
        --profile results/profile-8b-tp2.json --gpus 8 --input-len 2048 --output-len 256 \\
        --ttft-ms 1000 --itl-ms 50
    # its predictions against a measured sweep (loadtests.sweep's folder) or serving_bench JSON
    python -m loadtests.plan validate --profile results/profile-8b-tp1.json results/h100x2

``plan`` simulates, for every layout that fits ``--gpus`` (``coloN`` and ``PpDd``, each role at
each profiled tensor-parallel size, one GPU per rank), the highest Poisson rate at which
``--attainment`` of requests meet the TTFT and mean inter-token targets (a bisection), and ranks
the layouts by that goodput per GPU. ``--rate`` also reports every layout at that one load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtests import workloads
from loadtests.simulate import Profile, SimLayout, requests_for, simulate

ROOT = Path(__file__).resolve().parents[1]


# -- profile (on the device) ----------------------------------------------------------------------
def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout
        return ""


def _time_to_first(engine, prompt: list[int], params) -> float:
    """Seconds from adding ``prompt`` to its first token, with whatever else is running."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
        pass
    return time.perf_counter() - t0


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def profile_prefill(engine, lengths, vocab: int, rng) -> list[tuple[int, float]]:
    from engine import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = []
    for n in lengths:
        times = []
        for _ in range(3):
            engine.reset_prefix_cache()
            times.append(_time_to_first(engine, [rng.randrange(10, vocab) for _ in range(n)],
                                        one))
            _drain(engine)
        out.append((n, round(statistics.median(times) * 1e3, 3)))
    return out


def _start_batch(engine, batch: int, context: int, vocab: int, rng, max_tokens: int):
    """``batch`` sequences of one ``context``-token prompt (its KV computed once and shared by
    the prefix cache; each still reads all of it every step), all past their first token."""
    from engine import SamplingParams

    engine.reset_prefix_cache()
    prompt = [rng.randrange(10, vocab) for _ in range(context)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _time_to_first(engine, prompt, params)  # the prompt's KV, once
    ids = [engine.add_request(prompt, params) for _ in range(batch - 1)]
    started = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}


def profile_decode(engine, batches, contexts, vocab: int, rng, capacity: int, steps: int = 24):
    out = []
    for context in contexts:
        for batch in batches:
            if context + batch * (steps + 16) > capacity or batch > engine.config.max_num_seqs:
                continue
            _start_batch(engine, batch, context, vocab, rng, steps + 16)
            for _ in range(4):
                engine.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            out.append((batch, context, round((time.perf_counter() - t0) / steps * 1e3, 3)))
            _drain(engine)
    return out


def profile_mixed(engine, batch: int, context: int, lengths, vocab: int, rng):
    """A prompt's time to its first token while ``batch`` sequences decode: checks the model's
    sum of a decode step and a prefill."""
    from engine import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = []
    for n in lengths:
        _start_batch(engine, batch, context, vocab, rng, 64 + n // 64)
        for _ in range(3):
            engine.step()
        ms = _time_to_first(engine, [rng.randrange(10, vocab) for _ in range(n)], one) * 1e3
        out.append((batch, context, n, round(ms, 3)))
        _drain(engine)
    return out


def copy_gb_s(device) -> float:
    from benchmarks.lib import copy_ceiling

    if device.type == "cpu":
        return copy_ceiling(["cpu"], 2**26) / 1e9
    return copy_ceiling([device, device], 2**28) / 1e9


def profile(args) -> dict:
    import random

    import torch

    from engine import LLM

    kw = {"model": args.model, "tensor_parallel_size": args.tensor_parallel_size,
          "max_num_seqs": args.max_num_seqs, "show_progress": False,
          "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.quantization:
        kw["quantization"] = args.quantization
    llm = LLM(**{**kw, **args.engine})
    engine, rng = llm.engine, random.Random(0)
    cfg = engine.source.config
    vocab = min(cfg.vocab_size, 150000)
    capacity = engine.pool.num_usable_blocks * engine.config.block_size
    kv_elem = torch.empty(0, dtype=engine.runner.kv_dtype).element_size()
    gpu = torch.cuda.is_available()
    lengths = args.prefill_lengths or ([128, 512, 1024, 2048, 4096, 8192] if gpu
                                       else [16, 64, 128, 256, 512])
    batches = args.batches or ([1, 8, 32, 64, 128, 256] if gpu else [1, 4, 16, 32, 64])
    contexts = args.contexts or ([128, 1024, 4096] if gpu else [64, 256])
    _time_to_first(engine, [1] * 64, None)  # warm-up
    _drain(engine)
    out = {"model": args.model, "device": torch.cuda.get_device_name() if gpu else "CPU",
           "tensor_parallel_size": args.tensor_parallel_size,
           "max_num_seqs": engine.config.max_num_seqs,
           "max_num_batched_tokens": engine.config.max_num_batched_tokens,
           "kv_capacity_tokens": capacity,
           "kv_bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
           * cfg.head_dim * kv_elem,
           "prefill": profile_prefill(engine, lengths, vocab, rng),
           "decode": profile_decode(engine, batches, contexts, vocab, rng, capacity),
           "handover_fixed_ms": args.handover_fixed_ms,
           "handover_gb_s": args.handover_gb_s or round(copy_gb_s(engine.runner.device), 1),
           "serve_overhead_ms": args.serve_overhead_ms,
           "date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    mid = sorted(batches)[len(batches) // 2]
    out["mixed"] = profile_mixed(engine, mid, contexts[0], lengths[:4], vocab, rng)
    engine.shutdown()
    return Profile(**out).model_dump()


# -- plan (anywhere) -------------------------------------------------------------------------------
def workload(rate: float, duration_s: float, input_len: int, output_len: int, seed: int = 0):
    arrivals = workloads.arrival_times(rate, duration_s, "poisson", seed)
    return requests_for(arrivals, [input_len] * len(arrivals), [output_len] * len(arrivals))


def layouts_for(gpus: int, tps: list[int]) -> list[SimLayout]:
    """Every layout of whole GPUs that fits ``gpus``: colocated replicas of one size, and
    prefill and decode pools each of one size."""
    out = []
    for tp in tps:
        out += [SimLayout(0, n, decode_tp=tp) for n in range(1, gpus // tp + 1)]
    for ptp in tps:
        for dtp in tps:
            for p in range(1, gpus // ptp + 1):
                for d in range(1, (gpus - p * ptp) // dtp + 1):
                    out.append(SimLayout(p, d, prefill_tp=ptp, decode_tp=dtp))
    return out


def goodput(layout: SimLayout, profiles, args, low: float = 0.05) -> float:
    """The highest rate (req/s) at which ``attainment`` of requests meet the targets."""
    def meets(rate: float) -> bool:
        reqs = workload(rate, args.duration, args.input_len, args.output_len)
        if not reqs:
            return True
        r = simulate(layout, profiles, reqs, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms)
        return r["slo_fraction"] >= args.attainment

    if not meets(low):
        return 0.0
    hi = low
    while meets(hi * 2) and hi < 1e4:
        hi *= 2
    lo, hi = hi, hi * 2
    while hi / lo > 1.05:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def load_profiles(paths, args=None) -> dict[int, Profile]:
    """The profiles by tensor-parallel size, with the command line's fixed costs if given."""
    profiles = {}
    for path in paths:
        p = Profile.model_validate_json(Path(path).read_text())
        for key in ("handover_fixed_ms", "handover_gb_s", "serve_overhead_ms"):
            if getattr(args, key, None) is not None:
                p = p.model_copy(update={key: getattr(args, key)})
        profiles[p.tensor_parallel_size] = p
    return profiles


def plan(args) -> list[dict]:
    profiles = load_profiles(args.profile, args)
    rows = []
    for layout in layouts_for(args.gpus, sorted(profiles)):
        rate = goodput(layout, profiles, args)
        row = {"layout": layout.name, "gpus": layout.gpus, "goodput_rps": round(rate, 3),
               "goodput_rps_per_gpu": round(rate / layout.gpus, 3)}
        if args.rate:
            row["at_rate"] = simulate(layout, profiles, workload(
                args.rate, args.duration, args.input_len, args.output_len),
                ttft_ms=args.ttft_ms, itl_ms=args.itl_ms)
        rows.append(row)
    rows.sort(key=lambda r: -r["goodput_rps_per_gpu"])
    print(f"{'layout':12} {'GPUs':>4} {'goodput req/s':>13} {'per GPU':>8}")
    for r in rows[: args.top]:
        print(f"{r['layout']:12} {r['gpus']:4g} {r['goodput_rps']:13.2f} "
              f"{r['goodput_rps_per_gpu']:8.2f}")
    return rows


# -- validate: predictions against measured points -----------------------------------------------
def _sim_layout(name: str, gpus_per_replica: float, mode: str = "always") -> SimLayout:
    from loadtests.layouts import parse_layout

    shape = parse_layout(name.split(":", 1)[0])
    mode = name.split(":", 1)[1] if ":" in name else mode
    return SimLayout(shape.prefill, shape.decode, gpus_per_replica=gpus_per_replica or 1.0,
                     mode=mode)


def validate_sweep(run: Path, profiles) -> list[dict]:
    """Each point of a ``loadtests.sweep`` run, measured and predicted."""
    from loadtests.config import SweepConfig

    cfg = SweepConfig.model_validate_json((run / "config.json").read_text())
    spec = cfg.workload
    if spec.kind != "fixed":
        raise SystemExit(f"{run}: the planner models fixed-length workloads, not {spec.kind!r}")
    measured = json.loads((run / "summary.json").read_text())["points"]
    rows = []
    for point in measured:
        layout = _sim_layout(point["layout"], cfg.resources.num_gpus, cfg.disaggregation)
        arrivals = cfg.arrivals(point["load"])  # every locust process's sends
        reqs = requests_for(arrivals, [spec.input_len] * len(arrivals),
                            [spec.output_len] * len(arrivals))
        pred = simulate(layout, profiles, reqs, ttft_ms=cfg.slo.ttft_ms, itl_ms=cfg.slo.itl_ms,
                        window_s=cfg.duration_s,  # the sweep's drain ends its unfinished ones
                        deadline_s=cfg.duration_s + cfg.drain_s if cfg.open_loop else None)
        rows.append({"source": run.name, "layout": point["layout"], "load": point["load"],
                     "measured": point, "predicted": pred})
    return rows


def validate_burst(path: Path, profiles) -> list[dict]:
    """Each served point of a ``benchmarks.serving_bench`` JSON: all its streams at once."""
    run = json.loads(path.read_text())
    rows = []
    for point in run["served"]:
        if "-tp" in point["layout"]:
            continue
        n = point["streams"]
        long = workloads.long_prompts(run["args"].get("long_prompts"), n)
        inputs = [long.get(i, run["input_len"]) for i in range(n)]
        gpus = run["args"]["colo_gpus"] if point["layout"].startswith("colo") \
            else run["args"]["gpus_per_role"]
        layout = _sim_layout(point["layout"], gpus, run["args"].get("disaggregation", "always"))
        rate = run["args"].get("rate")  # serving_bench's open loop: the same send times
        arrivals = workloads.arrival_offsets(rate, n) if rate else [0.0] * n
        pred = simulate(layout, profiles, requests_for(arrivals, inputs,
                                                       [run["output_len"]] * n))
        measured = {"ttft_p50_ms": point["ttft_p50_ms"], "ttft_p99_ms": point["ttft_p99_ms"],
                    "itl_p50_ms": point.get("itl_p50_ms"), "itl_p99_ms": point.get("itl_p99_ms"),
                    "output_tok_s": point["tok_s"]}
        rows.append({"source": path.name, "layout": f"{point['layout']}/{point['protocol']}",
                     "load": f"{rate:g}/s" if rate else f"{n} at once", "measured": measured,
                     "predicted": pred})
    return rows


KEYS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "slo_fraction")


def validate(args) -> list[dict]:
    profiles = load_profiles(args.profile, args)
    rows = []
    for target in args.runs:
        path = Path(target)
        rows += validate_sweep(path, profiles) if path.is_dir() else \
            validate_burst(path, profiles)
    print(f"{'source':24} {'layout':16} {'load':>11}  " + "  ".join(
        f"{k + ' meas/pred':>26}" for k in KEYS))
    errors: dict[str, list[float]] = {k: [] for k in KEYS}
    for r in rows:
        cells = []
        for k in KEYS:
            m, p = r["measured"].get(k), r["predicted"].get(k)
            if m is None or p is None:
                cells.append(f"{'-':>26}")
                continue
            cells.append(f"{m:12.1f} / {p:11.1f}")
            if m and k != "slo_fraction":
                errors[k].append(abs(p - m) / abs(m))
            elif k == "slo_fraction":
                errors[k].append(abs(p - m))
        print(f"{r['source'][:24]:24} {r['layout']:16} {r['load']!s:>11}  " + "  ".join(cells))
    print("\nmedian error: " + ", ".join(
        f"{k} {100 * statistics.median(v):.0f}%{' (points)' if k == 'slo_fraction' else ''}"
        for k, v in errors.items() if v))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prof = sub.add_parser("profile", help="measure the engine's costs on this machine")
    prof.add_argument("--model", default="tiny")
    prof.add_argument("--tensor-parallel-size", type=int, default=1)
    prof.add_argument("--quantization", choices=["fp8"], default=None)
    prof.add_argument("--max-num-seqs", type=int, default=256)
    prof.add_argument("--max-num-batched-tokens", type=int, default=8192)
    prof.add_argument("--engine", type=json.loads, default={},
                      help="EngineConfig overrides as JSON (a sweep's engine, to check it)")
    prof.add_argument("--prefill-lengths", type=lambda s: [int(x) for x in s.split(",")])
    prof.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")])
    prof.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")])
    prof.add_argument("--handover-fixed-ms", type=float, default=5.0,
                      help="a hand-over's cost beside its bytes (serving_bench's zero-load "
                      "1P1D TTFT minus the colocated one)")
    prof.add_argument("--handover-gb-s", type=float, default=None,
                      help="the KV's copy rate between replicas (default: this device's copy)")
    prof.add_argument("--serve-overhead-ms", type=float, default=0.0,
                      help="the served path's time to a first token beside the engine's")
    prof.add_argument("--out", required=True)
    pl = sub.add_parser("plan", help="the layouts with the most goodput per GPU")
    val = sub.add_parser("validate", help="predictions against measured runs")
    for sp in (pl, val):
        sp.add_argument("--profile", action="append", required=True,
                        help="a profile JSON (one per tensor-parallel size)")
        sp.add_argument("--handover-fixed-ms", type=float, default=None,
                        help="replace the profiles' fixed hand-over cost")
        sp.add_argument("--handover-gb-s", type=float, default=None,
                        help="replace the profiles' hand-over rate (a profile measures one "
                             "device's copy; between GPUs the served push is slower)")
        sp.add_argument("--serve-overhead-ms", type=float, default=None,
                        help="replace the profiles' served-path time to a first token")
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--input-len", type=int, required=True)
    pl.add_argument("--output-len", type=int, required=True)
    pl.add_argument("--ttft-ms", type=float, required=True)
    pl.add_argument("--itl-ms", type=float, default=None, help="mean inter-token target")
    pl.add_argument("--attainment", type=float, default=0.9)
    pl.add_argument("--duration", type=float, default=60.0, help="simulated seconds per rate")
    pl.add_argument("--rate", type=float, default=None, help="also report each layout here")
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--json", default=None)
    val.add_argument("runs", nargs="+", help="loadtests.sweep folders, serving_bench JSON files")
    val.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.command == "profile":
        out = profile(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps({k: v for k, v in out.items() if k not in ("decode",)}, indent=1))
        return
    rows = plan(args) if args.command == "plan" else validate(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
