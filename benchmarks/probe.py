"""Probes of a running app, one tool: ``python -m benchmarks.probe {door|admission} [options]``.

``door``: hostile input at the door of a running app: huge bodies and prompts, and what they
cost everyone else. Against an app already up (``baton serve deploy/serve_config.yaml``, or the
README's ``serve deploy``):

    python -m benchmarks.probe door --url http://127.0.0.1:8000

Each probe sends one request while a thread asks ``/health`` every 20 ms; it prints the
probe's status and seconds, the slowest ``/health`` answer meanwhile (how long the ingress was
held), and the ingress replica's resident memory before and after (its process is found by
title, ``ray::ServeReplica:<app>:Router``).

``burst``: ``--streams`` (1,000) streaming requests at once against the shipped CPU config:
served, refused (429) and how fast, the served ones' TTFT (``python -m benchmarks.probe burst
--streams 1000``).

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
import asyncio
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


# -- burst ---------------------------------------------------------------------------------------
async def _burst(url: str, n: int, max_tokens: int, timeout: float) -> list[dict]:
    """``n`` streams started at once. Each row's ``seconds`` run from the burst's start to the
    answer's status; ``after_send`` from the moment its request was on the wire (aiohttp's
    last chunk sent: headers and body on the wire) to the status: a client of 1,000 connections
    in one Python process sends the last of them well after the first, on a small host."""
    import aiohttp

    body = {"prompt": "The request of a burst", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sent_at: dict[object, float] = {}

    async def on_sent(session, ctx, params) -> None:
        sent_at[ctx.trace_request_ctx] = time.monotonic()

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_sent)
    trace.on_request_headers_sent.append(on_sent)

    async def one(session, key: int) -> dict:
        t0 = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body,
                                    trace_request_ctx=key) as resp:
                answered, sent = time.monotonic(), sent_at.get(key, t0)
                row = {"status": resp.status, "seconds": answered - t0,
                       "after_send": answered - sent, "sent": sent - t0}
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    return row | {"at_door": "requests open here" in text,
                                  "at_haproxy": "requests open);" in text}
                first = None
                async for event in sse.aevents(resp.content):
                    if first is None and event.get("choices"):
                        first = time.monotonic() - t0
                return row | {"seconds": time.monotonic() - t0, "ttft": first}
        except Exception as exc:  # noqa: BLE001 - counted
            return {"status": type(exc).__name__, "seconds": time.monotonic() - t0}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout),
                                     trace_configs=[trace]) as session:
        return await asyncio.gather(*[one(session, i) for i in range(n)])


def _pcts(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {q: round(values[min(len(values) - 1, int(p * len(values)))], 2)
            for q, p in (("p50", 0.5), ("p99", 0.99))} | {"max": round(values[-1], 2)}


def burst_main(argv=None) -> None:
    """``burst``: ``--streams`` streaming requests at once against the shipped CPU config:
    how many are served and refused, how fast the refusals come, the served ones' TTFT."""
    p = argparse.ArgumentParser(description="a burst beyond the admission bounds")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--queue-timeout", type=float, default=None,
                   help="router.queue_timeout_s (default: the config's; 0: none)")
    p.add_argument("--no-early-refusal", action="store_true",
                   help="router.early_refusal false (no refusal at HAProxy or the door: by "
                        "Serve's bounds only)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    app_args = yaml.safe_load(Path("deploy/serve_config.yaml").read_text())["applications"][0]
    if args.no_early_refusal:
        app_args["args"].setdefault("router", {})["early_refusal"] = False
    if args.queue_timeout is not None:
        app_args["args"].setdefault("router", {})["queue_timeout_s"] = args.queue_timeout or None
    with local_ray(), served(app_args["args"]) as app:
        rows = asyncio.run(_burst(app.url, args.streams, args.max_tokens, args.timeout))
    refused = [r["seconds"] for r in rows if r["status"] == 429]
    served_ = [r for r in rows if r["status"] == 200]
    out = {"streams": args.streams, "served": len(served_), "refused_429": len(refused),
           "other": sorted({str(r["status"]) for r in rows} - {"200", "429"}),
           "refusal_seconds": _pcts(refused),
           "refusal_after_send_seconds": _pcts([r["after_send"] for r in rows
                                                if r["status"] == 429]),
           "sent_seconds": _pcts([r["sent"] for r in rows if "sent" in r]),
           "refused_at_door": sum(1 for r in rows if r.get("at_door")),
           "door_refusal_seconds": _pcts([r["seconds"] for r in rows if r.get("at_door")]),
           "refused_at_haproxy": sum(1 for r in rows if r.get("at_haproxy")),
           "haproxy_refusal_seconds": _pcts([r["seconds"] for r in rows
                                             if r.get("at_haproxy")]),
           "served_ttft_seconds": _pcts([r["ttft"] for r in served_ if r.get("ttft")])}
    print(json.dumps(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


TOOLS = {"door": door_main, "admission": admission_main, "burst": burst_main}


def main(argv=None) -> None:
    dispatch("probe", TOOLS, argv)


if __name__ == "__main__":
    main()
