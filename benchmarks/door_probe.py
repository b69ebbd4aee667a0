"""Hostile input at the door of a running app: huge bodies and prompts, and what they cost
everyone else. Against an app already up (``baton serve deploy/serve_config.yaml``, or the
README's ``serve deploy``):

    python -m benchmarks.door_probe --url http://127.0.0.1:8000

Each probe sends one request while a thread asks ``/health`` every 20 ms; it prints the
probe's status and seconds, the slowest ``/health`` answer meanwhile (how long the ingress was
held), and the ingress replica's resident memory before and after (its process is found by
title, ``ray::ServeReplica:<app>:Router``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import requests

from benchmarks.chaos_bench import replica_pids


def _rss_mb() -> float:
    from ray.thirdparty_files import psutil

    pids = replica_pids("Router")
    return sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20 if pids else 0.0


def _words(n_bytes: int) -> str:
    words = "the quick brown fox jumps over the lazy dog "
    return (words * (n_bytes // len(words) + 1))[:n_bytes]


def _probe(url: str, name: str, send) -> dict:
    slowest, stop = [0.0], threading.Event()

    def health():
        while not stop.is_set():
            t = time.perf_counter()
            try:
                requests.get(f"{url}/health", timeout=120)
            except requests.RequestException:
                pass
            slowest[0] = max(slowest[0], time.perf_counter() - t)
            stop.wait(0.02)

    before = _rss_mb()
    watcher = threading.Thread(target=health, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    try:
        status = send().status_code
    except requests.RequestException as exc:  # a server may close on a body it refused
        status = type(exc).__name__
    seconds = time.perf_counter() - t0
    time.sleep(0.2)
    stop.set()
    watcher.join()
    return {"probe": name, "status": status, "seconds": round(seconds, 3),
            "health_max_s": round(slowest[0], 3), "rss_before_mb": round(before),
            "rss_after_mb": round(_rss_mb())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    url = f"{args.url}/v1/completions"

    def body(n_bytes: int) -> bytes:
        return json.dumps({"prompt": _words(n_bytes), "max_tokens": 4}).encode()

    def chunks(data: bytes, size: int = 1 << 16):
        for i in range(0, len(data), size):
            yield data[i:i + size]

    probes = {
        "100 MB body": lambda: requests.post(url, data=body(100 << 20), headers=headers,
                                             timeout=300),
        "20 MB body, chunked": lambda: requests.post(url, data=chunks(body(20 << 20)),
                                                     headers=headers, timeout=300),
        "3.9 MB prompt": lambda: requests.post(url, data=body(3_900_000), headers=headers,
                                               timeout=300),
        "200 kB prompt": lambda: requests.post(url, data=body(200_000), headers=headers,
                                               timeout=300),
        "2 kB prompt": lambda: requests.post(url, data=body(2_000), headers=headers,
                                             timeout=300),
    }
    rows = [_probe(args.url, name, send) for name, send in probes.items()]
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
