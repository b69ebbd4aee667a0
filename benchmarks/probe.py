"""Probes of a running app, one tool: ``python -m benchmarks.probe {door|admission} [options]``.

``door``: hostile input at the door of a running app: huge bodies and prompts, and what they
cost everyone else. Against an app already up (``baton serve deploy/serve_config.yaml``, or the
README's ``serve deploy``):

    python -m benchmarks.probe door --url http://127.0.0.1:8000

Each probe sends one request while a thread asks ``/health`` every 20 ms; it prints the
probe's status and seconds, the slowest ``/health`` answer meanwhile (how long the ingress was
held), and the ingress replica's resident memory before and after (its process is found by
title, ``ray::ServeReplica:<app>:Router``).

``admission``: how long a short request waits beside long ones, and how fast an impossible one
is refused, on the shipped CPU config (``deploy/serve_config.yaml``: tiny, 1 prefill + 1 decode
replica).

    python -m benchmarks.probe admission --long 64 [--first-token-timeout 20] [--json F]

``--long`` streams ask for the whole context (2,046 new tokens after a 1-token prompt); a second
after they start, a 16-token request is sent with ``priority`` 0 and then one with ``priority``
-1, each timed to its first token (or its refusal); then one request of 128 prompts × ``n=128``.
Prints one line per probe.

"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import requests
import yaml

from benchmarks.lib import dispatch, local_ray, replica_pids, served
from loadtests import sse


# -- door ----------------------------------------------------------------------------------
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

def door_main(argv=None) -> None:
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


# -- admission -----------------------------------------------------------------------------
def _first_token(url: str, body: dict, timeout: float) -> tuple[int, float]:
    import requests

    t0 = time.monotonic()
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=timeout) as resp:
        if resp.status_code != 200:
            return resp.status_code, time.monotonic() - t0
        for event in sse.events(resp.iter_lines()):
            if event.get("choices"):
                return 200, time.monotonic() - t0
    return resp.status_code, time.monotonic() - t0

def admission_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", type=int, default=64)
    p.add_argument("--first-token-timeout", type=float, default=None,
                   help="router.first_token_timeout_s (default: the config's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    app_args = yaml.safe_load(Path("deploy/serve_config.yaml").read_text())["applications"][0]
    app_args = app_args["args"]
    if args.first_token_timeout is not None:
        app_args.setdefault("router", {})["first_token_timeout_s"] = args.first_token_timeout
    with local_ray(), served(app_args) as app:
        out = probe(app.url, args.long)
    out["router"] = app_args.get("router", {})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))

def probe(url: str, long: int) -> dict:
    """``long`` slot-filling streams, then a short request at two priorities and a fan-out."""
    import requests

    out = {"long": long}
    stop = threading.Event()

    def long_stream(i: int) -> None:
        body = {"prompt": [5 + i], "max_tokens": 2046, "ignore_eos": True, "temperature": 0,
                "stream": True}
        try:
            with requests.post(f"{url}/v1/completions", json=body, stream=True,
                               timeout=600) as resp:
                for _ in resp.iter_lines():
                    if stop.is_set():
                        return
        except Exception:  # noqa: BLE001 - closed at the end
            pass

    threads = [threading.Thread(target=long_stream, args=(i,), daemon=True)
               for i in range(long)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    short = {"prompt": "The short request", "max_tokens": 16, "temperature": 0}
    for prio in (0, -1):
        status, waited = _first_token(url, {**short, "priority": prio}, 600)
        out[f"short_priority_{prio}"] = {"status": status, "seconds": round(waited, 2)}
        print(f"16-token request, priority {prio:2d}, beside {long} long: {status} after "
              f"{waited:.2f} s", flush=True)
    t0 = time.monotonic()
    r = requests.post(f"{url}/v1/completions", timeout=600, json={
        "prompt": ["x"] * 128, "n": 128, "max_tokens": 4})
    out["fan_out_128x128"] = {"status": r.status_code, "seconds": round(time.monotonic() - t0, 2),
                              "message": r.json().get("error", {}).get("message")}
    print(f"128 prompts x n=128: {r.status_code} after {time.monotonic() - t0:.2f} s", flush=True)
    stop.set()
    return out


TOOLS = {"door": door_main, "admission": admission_main}


def main(argv=None) -> None:
    dispatch("probe", TOOLS, argv)


if __name__ == "__main__":
    main()
