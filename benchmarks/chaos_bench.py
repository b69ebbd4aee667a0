"""Kill a decode replica under load and measure what the clients saw.

A disaggregated app (1 prefill + ``--decode-replicas`` decode replicas), ``--streams`` streaming
requests of ``--output-len`` tokens (greedy, ``ignore_eos``); once every stream has
``--kill-after`` tokens, one decode replica's process gets SIGKILL. Reported: failed streams,
streams cut short, migrations (``baton_request_migrations_total``), and the stall of each moved
stream (its longest gap between two tokens) against the others' longest gap.

    python -m benchmarks.chaos_bench --model dummy:Qwen3-8B --gpus-per-role 0.3
    python -m benchmarks.chaos_bench --model tiny           # CPU

``--kill prefill``, ``--kill router`` (an ingress replica; ``--routers`` of them, 2 by default) or
``--kill decode --steady``: requests arrive at ``--rate`` per second for
``--seconds`` (each of ``--output-len`` tokens) and a third of the way in that role's (first)
replica's process gets SIGKILL; reported: failures, refusals (429) and the time to first token of
the requests sent after the kill (median and the slowest), against those sent before. With one
decode replica (``--decode-replicas 1``) that is the only decode replica's death, which the
prefill replica covers by decoding whole requests. ``--disaggregation`` sets where
prompts are prefilled (``always``: every one handed over, the case a dead prefill replica hurts).
``--burst N``: besides the steady arrivals, N requests sent at once right after the kill (the
moment when a new request can still meet the dying replica).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time

import requests

from benchmarks.lib import local_ray, migrations, replica_pids, served
from loadtests import sse

def stream(url: str, prompt: list[int], max_tokens: int, rec: dict, timeout: float) -> None:
    """One streaming completion; ``rec`` gets token count, arrival times and any error."""
    rec.update(tokens=0, times=[], error=None)
    try:
        resp = requests.post(f"{url}/v1/completions", timeout=timeout, stream=True,
                             json={"prompt": prompt, "stream": True, "max_tokens": max_tokens,
                                   "temperature": 0, "ignore_eos": True})
        if resp.status_code != 200:
            rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return
        for event in sse.events(resp.iter_lines()):
            if (error := sse.failure(event)) is not None:
                rec["error"] = error[:200]
            if n := len(sse.token_ids(event)):
                rec["tokens"] += n
                rec["times"].append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - reported
        rec["error"] = repr(exc)[:200]


def first_token(url: str, prompt: list[int], max_tokens: int, rec: dict, timeout: float) -> None:
    """One streaming completion; ``rec`` gets its time to first token (or its error)."""
    t0 = time.perf_counter()
    stream(url, prompt, max_tokens, rec, timeout)
    rec["ttft"] = rec["times"][0] - t0 if rec["times"] else None


def kill_under_steady_load(url: str, args, prompts, role: str) -> dict:
    """Steady arrivals; SIGKILL of the role's (first) replica a third of the way in."""
    recs, threads = [], []
    t0, killed_at = time.perf_counter(), None

    def send() -> None:  # the next prompt, on a thread of its own
        prompt = prompts[len(recs) % len(prompts)]
        rec = {"sent": time.perf_counter(), "sent_at": time.time()}
        recs.append(rec)
        th = threading.Thread(target=first_token,
                              args=(url, prompt, args.output_len, rec, args.timeout))
        th.start()
        threads.append(th)

    while time.perf_counter() - t0 < args.seconds:
        if killed_at is None and time.perf_counter() - t0 >= args.seconds / 3:
            os.kill(replica_pids(role)[0], signal.SIGKILL)
            killed_at = time.perf_counter()
            print(f"SIGKILL {role} replica", flush=True)
            for _ in range(args.burst):
                send()
        send()
        time.sleep(1 / args.rate)
    for th in threads:
        th.join(timeout=args.timeout)
    after = [r for r in recs if r["sent"] >= killed_at]
    before = [r for r in recs if r["sent"] < killed_at]

    def ttfts(rs):
        return sorted(r["ttft"] * 1e3 for r in rs if r.get("ttft") is not None)

    out = {"requests": len(recs), "failed": sum(1 for r in recs if r["error"]),
           "failed_sent_after_kill": sum(1 for r in after if r["error"]),
           "refused": sum(1 for r in recs if (r["error"] or "").startswith("HTTP 429")),
           "ttft_before_ms": ttfts(before), "ttft_after_ms": ttfts(after),
           "first_error": next((r["error"] for r in recs if r["error"]), None),
           "failures": [{"sent_after_kill_s": round(r["sent"] - killed_at, 4),
                         "sent_at": r["sent_at"], "error": r["error"]} for r in recs if r["error"]]}
    a, b = out["ttft_after_ms"] or [float("nan")], out["ttft_before_ms"] or [float("nan")]
    print(f"requests {len(recs)}, failed {out['failed']} ({out['failed_sent_after_kill']} sent "
          f"after the kill, {out['refused']} refused; first: "
          f"{out['first_error']}); TTFT before the kill p50 {statistics.median(b):.0f} ms; "
          f"after: p50 {statistics.median(a):.0f} ms, max {max(a):.0f} ms", flush=True)
    return {**out, "cut_short": 0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--kill-after", type=int, default=64, help="tokens every stream has first")
    p.add_argument("--decode-replicas", type=int, default=2)
    p.add_argument("--gpus-per-role", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--kill", choices=["decode", "prefill", "router"], default="decode")
    p.add_argument("--routers", type=int, default=2, help="ingress replicas")
    p.add_argument("--steady", action="store_true",
                   help="--kill decode under steady arrivals (as --kill prefill always is)")
    p.add_argument("--rate", type=float, default=3.0, help="steady load: requests per second")
    p.add_argument("--seconds", type=float, default=30.0, help="steady load: how long")
    p.add_argument("--burst", type=int, default=0,
                   help="steady load: requests sent at once right after the kill")
    p.add_argument("--disaggregation", choices=["auto", "always", "never"], default="always")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    gpu = torch.cuda.is_available()
    share = args.gpus_per_role if args.gpus_per_role is not None else \
        (round(0.95 / (1 + args.decode_replicas), 2) if gpu else 0.0)
    engine = {"model": args.model, "show_progress": False}
    if gpu:
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization * share
    role = {"num_gpus": share, "num_cpus": 1.0 if gpu else 0.5}
    config = {"mode": "disaggregated", "engine": engine, "prefill": role,
              "decode": {**role, "num_replicas": args.decode_replicas},
              "router": {"num_replicas": args.routers, "request_timeout_s": args.timeout},
              "disaggregation": {"mode": args.disaggregation},
              "transfer": {"backend": args.backend}}
    with local_ray(), served(config, args.timeout) as app:
        print(f"1P{args.decode_replicas}D of {args.model} ready in {app.ready_s:.0f}s "
              f"({share:g} GPU each)", flush=True)
        out = kill_under_load(app.url, args)
    out.update(model=args.model, device=torch.cuda.get_device_name() if gpu else "cpu",
               date=time.strftime("%Y-%m-%d"), decode_replicas=args.decode_replicas,
               gpus_per_role=share)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(1 if out["failed"] or out["cut_short"] else 0)


def kill_under_load(url: str, args) -> dict:
    """The streams, the kill once each has ``kill_after`` tokens, and what the clients saw."""
    import torch

    from engine.model_source import resolve_model

    g = torch.Generator().manual_seed(0)
    vocab = min(resolve_model(args.model).config.vocab_size, 150000)
    prompts = torch.randint(10, vocab, (args.streams, args.input_len), generator=g).tolist()
    stream(url, prompts[0][:16], 4, {}, args.timeout)  # warm-up
    if args.kill != "decode" or args.steady:
        role = {"prefill": "PrefillServer", "router": "Router"}.get(args.kill, "DecodeServer")
        return kill_under_steady_load(url, args, prompts, role)
    recs = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(url, pr, args.output_len, r, args.timeout))
               for pr, r in zip(prompts, recs)]
    for t in threads:
        t.start()
    deadline = time.time() + args.timeout
    while time.time() < deadline and min(r.get("tokens", 0) for r in recs) < args.kill_after:
        time.sleep(0.01)
    victims = replica_pids("DecodeServer")
    killed_at = time.perf_counter()
    os.kill(victims[0], signal.SIGKILL)
    print(f"SIGKILL decode replica pid {victims[0]} of {len(victims)}", flush=True)
    for t in threads:
        t.join(timeout=args.timeout)
    moved = migrations(url)

    def longest_gap(r):
        ts = r["times"]
        return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)

    def gap_across_kill(r):
        ts = r["times"]
        return max((b - a for a, b in zip(ts, ts[1:]) if a <= killed_at <= b), default=0.0)

    failed = [r for r in recs if r["error"]]
    short = [r for r in recs if not r["error"] and r["tokens"] != args.output_len]
    across = sorted(gap_across_kill(r) * 1e3 for r in recs if not r["error"])
    typical = statistics.median(
        statistics.median([b - a for a, b in zip(r["times"], r["times"][1:])] or [0.0])
        for r in recs if not r["error"]) * 1e3
    print(f"streams {args.streams}, failed {len(failed)}, cut short {len(short)}, "
          f"migrations {moved:g}; token gap across the kill (ms): p50 "
          f"{statistics.median(across):.0f}, max {max(across):.0f}; typical gap "
          f"{typical:.1f} ms", flush=True)
    return {"streams": args.streams, "output_len": args.output_len, "failed": len(failed),
            "cut_short": len(short), "migrations": moved, "gap_across_kill_ms": across,
            "typical_gap_ms": typical, "longest_gap_ms": max(longest_gap(r) for r in recs) * 1e3,
            "first_error": failed[0]["error"] if failed else None}


if __name__ == "__main__":
    main()
