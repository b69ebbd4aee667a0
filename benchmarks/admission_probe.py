"""How long a short request waits beside long ones, and how fast an impossible one is refused,
on the shipped CPU config (``deploy/serve_config.yaml``: tiny, 1 prefill + 1 decode replica).

    python -m benchmarks.admission_probe --long 64 [--first-token-timeout 20] [--json F]

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

import yaml

from loadtests import sse


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", type=int, default=64)
    p.add_argument("--first-token-timeout", type=float, default=None,
                   help="router.first_token_timeout_s (default: the config's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import ray
    import requests
    from ray import serve

    from deploy import ray_env
    from deploy.app import build_app
    from deploy.cli import wait_ready

    app_args = yaml.safe_load(Path("deploy/serve_config.yaml").read_text())["applications"][0]
    app_args = app_args["args"]
    if args.first_token_timeout is not None:
        app_args.setdefault("router", {})["first_token_timeout_s"] = args.first_token_timeout
    ray_env.apply()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    port = ray_env.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args), name="baton", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 300)
    out = {"long": args.long, "router": app_args.get("router", {})}
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
               for i in range(args.long)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    short = {"prompt": "The short request", "max_tokens": 16, "temperature": 0}
    for prio in (0, -1):
        status, waited = _first_token(url, {**short, "priority": prio}, 600)
        out[f"short_priority_{prio}"] = {"status": status, "seconds": round(waited, 2)}
        print(f"16-token request, priority {prio:2d}, beside {args.long} long: {status} after "
              f"{waited:.2f} s", flush=True)
    t0 = time.monotonic()
    r = requests.post(f"{url}/v1/completions", timeout=600, json={
        "prompt": ["x"] * 128, "n": 128, "max_tokens": 4})
    out["fan_out_128x128"] = {"status": r.status_code, "seconds": round(time.monotonic() - t0, 2),
                              "message": r.json().get("error", {}).get("message")}
    print(f"128 prompts x n=128: {r.status_code} after {time.monotonic() - t0:.2f} s", flush=True)
    stop.set()
    serve.shutdown()
    ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
