"""Serve the app on the GPU host and measure a short run: colocated, then 1P1D.

    python -m benchmarks.serving_smoke --model dummy:Qwen3-8B --gpus-per-role 0.5   # one GPU
    python -m benchmarks.serving_smoke --model dummy:Qwen3-8B --gpus-per-role 1     # two GPUs
    python -m benchmarks.serving_smoke --model dummy:Qwen3-0.6B --gpus-per-role 0.5 \
        --decode-replicas 2 --repeat 3    # two GPUs: 1 prefill + 2 decode, one sharing its GPU

Sends the same greedy requests (token-id prompts) to each layout one after another and prints
TTFT, decode tokens/s per request and whether the tokens equal the colocated layout's. For the
disaggregated layout it also prints where each replica runs (its GPU, from nvidia-smi), the
prefill replicas' KV links (``transfer.warm_links``) and the output tokens each decode replica
made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import requests

from benchmarks.lib import local_ray, served
from loadtests import sse


def run_layout(config: dict, prompts, max_tokens: int, timeout: float) -> list[dict]:
    with served(config, timeout) as app:
        print(f"{config['mode']}: ready in {app.ready_s:.1f}s", flush=True)
        rows = [one_request(app.url, config["mode"], prompt, max_tokens, timeout)
                for prompt in prompts]
        if config["mode"] == "disaggregated":
            placement(config["decode"].get("num_replicas", 1))
    return rows


def one_request(url: str, mode: str, prompt, max_tokens: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    resp = requests.post(f"{url}/v1/completions", stream=True, timeout=timeout,
                         json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}})
    times, tokens, usage = [], [], None
    for ev in sse.events(resp.iter_lines()):
        usage = ev.get("usage") or usage
        if new := sse.token_ids(sse.check(ev)):
            times.append(time.perf_counter() - t0)
            tokens += new
    decode_s = times[-1] - times[0]
    return dict(mode=mode, prompt_tokens=len(prompt), tokens=tokens, ttft_ms=times[0] * 1e3,
                decode_tok_s=(len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
                transfer=(usage or {}).get("kv_transfer"))


def placement(decode_replicas: int) -> None:
    """Each replica's GPU, the prefill replicas' links, each decode replica's output tokens."""
    import subprocess

    from benchmarks.lib import replica_pids
    from deploy.ray_env import driver_handle

    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout
        gpu_of = {int(pid): bus.strip() for pid, bus in
                  (line.split(",") for line in apps.strip().splitlines())}
    except (OSError, ValueError, subprocess.SubprocessError):
        gpu_of = {}
    for name in ("PrefillServer", "DecodeServer"):
        for pid in replica_pids(name):
            print(f"placement: {name} pid {pid} on GPU {gpu_of.get(pid, '?')}", flush=True)
    seen = {}
    for _ in range(4 * decode_replicas):
        load = driver_handle("DecodeServer").kv_load.remote().result(timeout_s=30)
        seen[load["endpoint_id"]] = load["output_tokens"]
    links = driver_handle("PrefillServer").kv_load.remote().result(timeout_s=30)["links"]
    print(f"placement: prefill links {links}", flush=True)
    print(f"placement: decode replicas (endpoint: output tokens) {seen}, {len(seen)} of "
          f"{decode_replicas} answered", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:Qwen3-8B")
    p.add_argument("--gpus-per-role", type=float, default=0.5)
    p.add_argument("--backend", default="auto")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--lengths", type=int, nargs="*", default=[32, 32, 512, 2048])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--role-cpus", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=1, help="send the prompts this many times")
    args = p.parse_args(argv)
    import torch
    gen = torch.Generator().manual_seed(0)
    from engine.model_source import resolve_model
    vocab = resolve_model(args.model).config.vocab_size
    prompts = [torch.randint(10, vocab - 1, (n,), generator=gen).tolist()
               for n in args.lengths] * args.repeat
    engine = {"model": args.model, "num_blocks": args.num_blocks, "max_num_seqs": 16,
              "max_num_batched_tokens": 4096}
    role = {"num_gpus": args.gpus_per_role, "num_cpus": args.role_cpus}
    with local_ray():
        colocated = run_layout({"mode": "colocated", "engine": engine, "decode": role},
                               prompts, args.max_tokens, args.timeout)
        disagg = run_layout({"mode": "disaggregated", "engine": engine, "prefill": role,
                             "decode": {**role, "num_replicas": args.decode_replicas},
                             "transfer": {"backend": args.backend}},
                            prompts, args.max_tokens, args.timeout)
    for a, b in zip(colocated, disagg):
        b["same_tokens_as_colocated"] = a["tokens"] == b["tokens"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(colocated + disagg, f, indent=1)
    print(f"\n{'mode':14} {'prompt':>6} {'TTFT ms':>8} {'decode tok/s':>12} {'same':>5} transfer")
    for r in colocated + disagg:
        t = r["transfer"]
        moved = f"{t['bytes'] / 1e6:.0f} MB {t['seconds'] * 1e3:.2f} ms {t['backend']}" if t else "-"
        print(f"{r['mode']:14} {r['prompt_tokens']:6d} {r['ttft_ms']:8.1f} "
              f"{r['decode_tok_s']:12.1f} {str(r.get('same_tokens_as_colocated', '')):>5} {moved}")
    for mode in ("colocated", "disaggregated"):
        rs = [r for r in colocated + disagg if r["mode"] == mode]
        print(f"{mode}: median TTFT {statistics.median(r['ttft_ms'] for r in rs):.1f} ms, median "
              f"decode {statistics.median(r['decode_tok_s'] for r in rs):.1f} tok/s")


if __name__ == "__main__":
    main()
