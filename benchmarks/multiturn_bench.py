"""Multi-turn conversations whose KV outgrows the device cache, with and without the host tier
(``kv_offloading_size``), on the offline engine or served (``--served colo|1p1d``).

    python -m benchmarks.multiturn_bench --model dummy:Qwen3-8B --conversations 32 --turns 6 \
        --system 2048 --turn-tokens 1024 --output 128 --device-kv-gb 12 --host-gb 48 \
        --json results/multiturn.json
    python -m benchmarks.multiturn_bench ... --served 1p1d --think-s 1   # over HTTP

Every conversation shares a system prompt of ``--system`` tokens; each turn adds a user
message of ``--turn-tokens`` tokens to its history (and the answer of ``--output`` tokens once
it is made). A turn sends every conversation's next request at once and waits for them all
(or, with ``--think-s``, each conversation returns that long after its own answer), so
by the last turn each history is ``system + turns x (turn + output)`` tokens, and together they
hold far more KV than ``--device-kv-gb``: without the tier a returning conversation's prefix has
been evicted and is computed again; with it, its blocks come back from host memory. Reported per
setting: the first turn's and the returning turns' time to first token (p50/p99, from the
turn's start), output tokens/s over the whole run, the mean decode-only step, the tier's blocks
found and bytes copied each way with the copies' own rate each way (bytes over the seconds they
took on their side stream), and the host link's pinned copy rate measured in the same process
(``--host-gb 0`` runs the engine without the tier). ``--turns 1 --system 0``: a load with no
reuse, where the tier can only cost (its copies out run beside every step).

``--served``: the same conversations (token-id prompts, greedy, streamed) over HTTP against an
app of the benchmark's own on a local Ray, HAProxy in front: ``colo`` (one colocated replica) or
``1p1d`` (a prefill and a decode replica, every prompt handed over, half a GPU each on one GPU,
or a GPU each with ``--gpus-per-role 1``; ``--disaggregation-mode auto``: the app's default
placement instead, where a prompt whose uncached part, after the decode replica's GPU cache and
host tier, is at most ``--max-local-prefill-length`` tokens is prefilled on the decode replica);
the tier on every engine. Each conversation is a client thread. Also reported: the KV blocks the
hand-overs moved (``1p1d``: a returning turn whose history the decode replica holds, on its GPU
or in its tier, moves only the rest), each role's tier counters, and ``returning_hops_ms``: the
median of each hop to the returning turns' first tokens (the timings the app returns, as
``serving_bench`` reports them) and how many returning turns found no room on the decode replica
and had their first token made by the prefill replica (``--first-token-while-queued off``: they
wait for the room), and where the returning turns were prefilled (``returning_prefilled``).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from engine.snapshot import host_tier_figures


def pinned_copy_gbps(gb: float = 1.0) -> dict:
    """Host ↔ device copy rate of one pinned buffer (GB/s each way), on CUDA."""
    if not torch.cuda.is_available():
        return {}
    n = int(gb * 2**30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"to_device": (dev, host), "to_host": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = round(3 * n / (time.perf_counter() - t0) / 1e9, 1)
    return out


def decode_step_ms(stats) -> float | None:
    """The mean of the steps that computed no prompt token (``EngineStats``), in ms."""
    steps = stats.steps - stats.prompt_steps
    return round((stats.step_seconds - stats.prompt_step_seconds) / steps * 1e3, 3) \
        if steps else None


def copy_rates(figures: dict) -> dict:
    """The host tier's copies' own rate each way (GB/s: the bytes of the copies that landed
    over the seconds they took), from ``engine.snapshot.host_tier_figures``."""
    return {f"copy_GBps_{way}": round(nbytes / seconds / 1e9, 2)
            if (nbytes := figures[f"host_timed_bytes_{way}"])
            and (seconds := figures[f"host_seconds_{way}"]) else None
            for way in ("to_host", "to_device")}


def _pcts(values: list[float]) -> dict:
    v = sorted(values)
    return {"p50": round(statistics.median(v) * 1e3, 1),
            "p99": round(v[min(len(v) - 1, int(0.99 * len(v)))] * 1e3, 1)} if v else {}


def longest(args) -> int:
    """Tokens of a conversation's last request and its answer (the context the engine needs)."""
    return args.system + args.turns * (args.turn_tokens + args.output) + 16


def engine_args(args, host_gb: float) -> dict:
    """The engine's settings, offline and served alike."""
    kw = dict(model=args.model, max_num_seqs=args.conversations, max_model_len=longest(args),
              max_num_batched_tokens=args.batched_tokens, kv_offloading_size=host_gb)
    if args.device_kv_gb:
        kw["kv_cache_memory_gb"] = args.device_kv_gb
    if args.num_blocks:
        kw["num_blocks"] = args.num_blocks
    return kw


def run(args, host_gb: float) -> dict:
    engine = LLMEngine(EngineConfig(**engine_args(args, host_gb), show_progress=False, seed=0))
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    system = rand(args.system)
    histories = [system + rand(args.turn_tokens) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    produced, t_all = 0, time.perf_counter()
    if args.think_s is None:  # every conversation's next turn at once, turn after turn
        for turn in range(args.turns):
            t0 = time.perf_counter()
            rids = {engine.add_request(h, params): c for c, h in enumerate(histories)}
            answers: dict[str, list[int]] = {rid: [] for rid in rids}
            first: dict[str, float] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.new_token_ids and out.request_id not in first:
                        first[out.request_id] = time.perf_counter() - t0
                    answers[out.request_id] += out.new_token_ids
            ttft[turn] = list(first.values())
            for rid, c in rids.items():
                produced += len(answers[rid])
                histories[c] = histories[c] + answers[rid] + rand(args.turn_tokens)
    else:  # each conversation returns think_s after its answer, at its own time
        turn_of = [0] * args.conversations
        due = {c: t_all + c * args.stagger_s for c in range(args.conversations)}
        live: dict[str, tuple[int, float]] = {}  # request -> (conversation, sent at)
        answers, first = {}, set()
        while due or live:
            now = time.perf_counter()
            for c in [c for c, t in due.items() if t <= now]:
                del due[c]
                rid = engine.add_request(histories[c], params)
                live[rid], answers[rid] = (c, now), []
            if not engine.has_unfinished_requests():
                time.sleep(0.001)
                continue
            for out in engine.step():
                c, sent = live[out.request_id]
                if out.new_token_ids and out.request_id not in first:
                    first.add(out.request_id)
                    ttft[turn_of[c]].append(time.perf_counter() - sent)
                answers[out.request_id] += out.new_token_ids
                if out.finished:
                    del live[out.request_id]
                    produced += len(answers[out.request_id])
                    histories[c] = histories[c] + answers.pop(out.request_id) \
                        + rand(args.turn_tokens)
                    turn_of[c] += 1
                    if turn_of[c] < args.turns:
                        due[c] = time.perf_counter() + args.think_s
    seconds = time.perf_counter() - t_all
    block = engine.runner.block_bytes
    row = {"host_gb": host_gb, "device_kv_blocks": engine.pool.num_usable_blocks,
           "device_kv_gb": round(engine.pool.num_usable_blocks * block / 2**30, 2),
           "working_set_gb": round(args.conversations * longest(args) * block
                                   / engine.config.block_size / 2**30, 2),
           "first_turn_ttft_ms": _pcts(ttft[0]),
           "returning_ttft_ms": _pcts([t for k, v in ttft.items() if k for t in v]),
           "last_turn_ttft_ms": _pcts(ttft[args.turns - 1]),
           "output_tok_s": round(produced / seconds, 1), "seconds": round(seconds, 2),
           "prefix_hit_rate": round(engine.pool.hit_rate, 3),
           "decode_step_ms": decode_step_ms(engine.stats)}
    if (figures := host_tier_figures(engine)):
        row.update(host_blocks=engine.host_tier.num_blocks,
                   host_hit_blocks=figures["host_hit_blocks"],
                   gb_to_host=round(figures["host_bytes_to_host"] / 1e9, 2),
                   gb_to_device=round(figures["host_bytes_to_device"] / 1e9, 2),
                   **copy_rates(figures))
    engine.shutdown()
    return row


def run_served(args, host_gb: float) -> dict:
    """The conversations over HTTP (see the module's docstring)."""
    import threading

    import requests

    from benchmarks.lib import local_ray, served
    from benchmarks.serving_bench import breakdown
    from deploy.ray_env import driver_handle
    from engine.model_source import resolve_model

    disagg = args.served == "1p1d"
    engine = engine_args(args, host_gb)
    gpus = torch.cuda.device_count()
    share = args.gpus_per_role or (0.5 if disagg else 1.0)
    role = {"num_cpus": 0.5, "num_gpus": share if gpus else 0.0}
    config = {"mode": "disaggregated" if disagg else "colocated", "engine": engine,
              "decode": role, "router": {"num_replicas": 2, "num_cpus": 0.25,
                                         "request_timeout_s": 600}}
    if disagg:
        config |= {"prefill": role, "disaggregation": {
            "mode": args.disaggregation_mode,
            "max_local_prefill_length": args.max_local_prefill_length,
            "first_token_while_queued": args.first_token_while_queued == "on"}}
    g = torch.Generator().manual_seed(0)
    vocab = min(resolve_model(args.model).config.vocab_size, 150000)

    def rand(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    system = rand(args.system)
    messages = [[rand(args.turn_tokens) for _ in range(args.turns)]
                for _ in range(args.conversations)]
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    moved, produced, errors, timed = [0], [0], [], []
    lock = threading.Lock()
    barrier = threading.Barrier(args.conversations) if args.think_s is None else None

    def conversation(url: str, c: int, t_start: float) -> None:
        history = system + messages[c][0]
        session = requests.Session()
        if barrier is None:
            time.sleep(max(0.0, t_start + c * args.stagger_s - time.perf_counter()))
        for turn in range(args.turns):
            if barrier is not None:
                barrier.wait(timeout=600)
            elif turn:
                time.sleep(args.think_s)
            t0, first, answer, blocks = time.perf_counter(), None, [], 0
            rec = {"sent": time.time(), "first": None, "timing": None, "where": None}
            try:
                with session.post(f"{url}/v1/completions", stream=True, timeout=600, json={
                        "prompt": history, "max_tokens": args.output, "temperature": 0,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True, "include_timing": True}}) \
                        as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        event = json.loads(line[6:])
                        for choice in event.get("choices", []):
                            if choice.get("token_ids") and first is None:
                                first = time.perf_counter() - t0
                                rec["first"] = time.time()
                            answer += choice.get("token_ids") or []
                        usage = event.get("usage") or {}
                        rec["timing"] = usage.get("timing", rec["timing"])
                        if isinstance(usage.get("prefilled"), dict):
                            rec["where"] = usage["prefilled"].get("where")
                        transfer = usage.get("kv_transfer") or {}
                        blocks += transfer.get("blocks_sent", 0) if isinstance(transfer, dict) \
                            else 0
            except (requests.RequestException, ValueError) as exc:
                with lock:
                    errors.append(f"conversation {c} turn {turn}: {exc}"[:300])
                if barrier is not None:
                    barrier.abort()
                return
            with lock:
                ttft[turn].append(first if first is not None else float("nan"))
                moved[0] += blocks
                produced[0] += len(answer)
                if turn:
                    timed.append(rec)
            if turn + 1 < args.turns:
                history = history + answer + messages[c][turn + 1]

    with local_ray(), served(config, 600) as app:
        t_all = time.perf_counter()
        threads = [threading.Thread(target=conversation, args=(app.url, c, t_all), daemon=True)
                   for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=3600)
        seconds = time.perf_counter() - t_all
        tiers = {role: {k: v for k, v in driver_handle(role).kv_load.remote().result().items()
                        if k.startswith("host_")}
                 for role in ("DecodeServer",) + (("PrefillServer",) if disagg else ())}
        for figures in tiers.values():
            figures.update(copy_rates(figures))
    return {"served": args.served, "host_gb": host_gb, "errors": errors,
            "first_turn_ttft_ms": _pcts(ttft[0]),
            "returning_ttft_ms": _pcts([t for k, v in ttft.items() if k for t in v]),
            "last_turn_ttft_ms": _pcts(ttft[args.turns - 1]),
            "output_tok_s": round(produced[0] / seconds, 1), "seconds": round(seconds, 2),
            "kv_blocks_moved": moved[0], "tiers": tiers,
            # returning turns that found no room on the decode replica and had their first
            # token made by the prefill replica meanwhile
            "returning_first_token_by_prefill": sum(
                bool(((r["timing"] or {}).get("decode") or {}).get("first_token_by_prefill"))
                for r in timed),
            "returning_turns": len(timed),
            # where the returning turns were prefilled (the app's answer: "local", "remote")
            "returning_prefilled": dict(collections.Counter(str(r["where"]) for r in timed)),
            "returning_hops_ms": {k: round(v, 1) for k, v in breakdown(timed).items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=2048)
    p.add_argument("--turn-tokens", type=int, default=1024)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--device-kv-gb", type=float, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--host-gb", type=float, default=48.0, help="the tier's size in the run with it")
    p.add_argument("--think-s", type=float, default=None,
                   help="each conversation returns this long after its answer, at its own "
                        "time (default: every conversation's turn at once, turn after turn)")
    p.add_argument("--stagger-s", type=float, default=0.2,
                   help="with --think-s: the conversations' first turns this far apart")
    p.add_argument("--served", choices=["colo", "1p1d"], default=None,
                   help="over HTTP against an app of its own: one colocated replica, or 1P1D "
                        "with every prompt handed over (default: the offline engine)")
    p.add_argument("--gpus-per-role", type=float, default=None,
                   help="--served: each replica's share of a GPU (default: a whole one "
                        "colocated, half of one each in 1p1d; 1 in 1p1d: a GPU per role)")
    p.add_argument("--first-token-while-queued", choices=["on", "off"], default="on",
                   help="--served 1p1d: a returning turn that finds no room on the decode "
                        "replica has its first token made by the prefill replica meanwhile "
                        "(disaggregation.first_token_while_queued)")
    p.add_argument("--disaggregation-mode", choices=["always", "auto"], default="always",
                   help="--served 1p1d: every prompt handed over, or the app's default "
                        "placement (auto: prefilled on the decode replica when the part its "
                        "GPU cache and host tier lack is short)")
    p.add_argument("--max-local-prefill-length", type=int, default=1000,
                   help="--disaggregation-mode auto: the longest uncached part prefilled on "
                        "the decode replica (disaggregation.max_local_prefill_length)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = {"args": vars(args), "pinned_copy_GBps": pinned_copy_gbps(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    print(json.dumps(out["pinned_copy_GBps"]), flush=True)
    for host_gb in (args.host_gb, 0.0):
        row = run_served(args, host_gb) if args.served else run(args, host_gb)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    with_tier, without = out["rows"]
    if with_tier["returning_ttft_ms"] and without["returning_ttft_ms"]:
        out["returning_ttft_p50_x"] = round(without["returning_ttft_ms"]["p50"]
                                            / with_tier["returning_ttft_ms"]["p50"], 2)
        out["tok_s_x"] = round(with_tier["output_tok_s"] / without["output_tok_s"], 2)
        print(f"returning turns' TTFT p50 {out['returning_ttft_p50_x']}x lower with the tier, "
              f"output tok/s {out['tok_s_x']}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
