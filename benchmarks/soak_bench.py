"""Memory under steady load: every replica's resident memory (RSS) over a long run.

A disaggregated app (1 prefill + 1 decode replica and the ingress, HAProxy in front as the
shipped configs run it) takes ``--rate`` streaming requests per second of ``--input-len`` random
prompt tokens and ``--output-len`` output tokens for ``--minutes``; every ``--sample-s`` seconds
the RSS of each replica process (ingress, decode, prefill) is recorded. Reported per process:
RSS after the warm-up (the first ``--warm-up-min`` minutes), at the end, and the slope over the
second half of the run in MB per 10 minutes (flat memory: a slope near zero), plus the requests
served and failed. ``--plot PNG`` draws RSS against time.

    python -m benchmarks.soak_bench --minutes 30 --json docs/data/soak_cpu.json   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import requests

from benchmarks.lib import local_ray, replica_pids, served
from loadtests import sse

ROLES = {"ingress": "Router", "decode": "DecodeServer", "prefill": "PrefillServer"}


def rss_mb(pids: dict[str, list[int]]) -> dict[str, float]:
    """Resident memory (MB) of each role's first replica process (0 if it is gone)."""
    from ray.thirdparty_files import psutil

    out = {}
    for role, ps in pids.items():
        try:
            out[role] = psutil.Process(ps[0]).memory_info().rss / 2**20
        except (IndexError, psutil.Error):
            out[role] = 0.0
    return out


def one_request(url: str, prompt: list[int], max_tokens: int, counts: dict,
                lock: threading.Lock) -> None:
    ok = False
    try:
        resp = requests.post(f"{url}/v1/completions", timeout=120, stream=True, json={
            "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
        tokens = sum(len(sse.token_ids(e)) for e in sse.events(resp.iter_lines()))
        ok = resp.status_code == 200 and tokens == max_tokens
    except requests.RequestException:
        pass
    with lock:
        counts["ok" if ok else "failed"] += 1


def slope_mb_per_10min(series: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per 10 minutes."""
    n = len(series)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in series) / n
    mv = sum(v for _, v in series) / n
    var = sum((t - mt) ** 2 for t, _ in series)
    return 600 * sum((t - mt) * (v - mv) for t, v in series) / var if var else 0.0


def summarize(samples: list[dict], warm_up_s: float) -> dict:
    """Per role: RSS after the warm-up, at the end, and the slope over the second half."""
    end = samples[-1]["t"]
    out = {}
    for role in samples[0]["rss_mb"]:
        warm = next((s for s in samples if s["t"] >= warm_up_s), samples[-1])
        half = [(s["t"], s["rss_mb"][role]) for s in samples if s["t"] >= end / 2]
        out[role] = {"after_warm_up_mb": round(warm["rss_mb"][role], 1),
                     "end_mb": round(samples[-1]["rss_mb"][role], 1),
                     "second_half_slope_mb_per_10min": round(slope_mb_per_10min(half), 2)}
    return out


def plot(samples: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for role in samples[0]["rss_mb"]:
        ax.plot([s["t"] / 60 for s in samples], [s["rss_mb"][role] for s in samples],
                label=role)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS, MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def soak(url: str, args) -> dict:
    import random

    rng = random.Random(0)
    pids = {role: replica_pids(name) for role, name in ROLES.items()}
    counts, lock, threads = {"ok": 0, "failed": 0}, threading.Lock(), []
    samples, t0 = [], time.monotonic()
    next_sample = next_request = t0
    while (now := time.monotonic()) - t0 < args.minutes * 60:
        if now >= next_sample:
            samples.append({"t": round(now - t0, 1), "rss_mb": rss_mb(pids),
                            "served": counts["ok"], "failed": counts["failed"]})
            next_sample += args.sample_s
        if now >= next_request:
            prompt = [rng.randrange(10, 500) for _ in range(args.input_len)]
            th = threading.Thread(target=one_request, daemon=True,
                                  args=(url, prompt, args.output_len, counts, lock))
            th.start()
            threads.append(th)
            next_request += 1 / args.rate
        threads = [t for t in threads if t.is_alive()]
        time.sleep(max(0.0, min(next_sample, next_request) - time.monotonic()))
    for t in threads:
        t.join(timeout=120)
    samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": rss_mb(pids),
                    "served": counts["ok"], "failed": counts["failed"]})
    return {"samples": samples, **counts,
            "summary": summarize(samples, args.warm_up_min * 60)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warm-up-min", type=float, default=3.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG")
    args = p.parse_args(argv)
    config = {"mode": "disaggregated", "engine": {"model": args.model},
              "disaggregation": {"mode": "always"}}
    with local_ray(), served(config, 300) as app:
        print(f"1P1D of {args.model} ready in {app.ready_s:.0f}s; {args.rate:g} requests/s "
              f"for {args.minutes:g} min", flush=True)
        out = soak(app.url, args)
    out.update(model=args.model, date=time.strftime("%Y-%m-%d"), args=vars(args))
    print(f"served {out['ok']}, failed {out['failed']}")
    print(f"{'process':10} {'after warm-up MB':>17} {'end MB':>8} {'2nd-half MB/10 min':>19}")
    for role, s in out["summary"].items():
        print(f"{role:10} {s['after_warm_up_mb']:17.1f} {s['end_mb']:8.1f} "
              f"{s['second_half_slope_mb_per_10min']:19.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(out["samples"], args.plot)


if __name__ == "__main__":
    main()
