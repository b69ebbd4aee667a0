"""Baton on a multi-node Ray cluster on one machine (several raylets, each its own node id), as
``tests/test_multinode_e2e.py`` runs it in a process of its own:

    python -m tests.multinode --out result.json

Nodes: a head (ingress), ``P`` with the resource ``prefill_pool``, ``D`` with ``decode_pool``,
and ``C`` with both. Scenario ``pools``: two prefill and two decode replicas pinned to the pools
by ``resources`` (so prefill on P and C, decode on D and C: cross-node pairs and one same-node
pair). Scenario ``fan_in``: one prefill replica, decode replicas on two nodes. Each scenario
sends greedy requests until both kinds of pair have been seen (or a bound), then reads every
replica's KV gauges. The result (tokens, the transfer of each request, the gauges) is written as
JSON for the test to check."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"model": "tiny", "num_blocks": 256, "max_num_seqs": 8}
PROMPTS = [f"Request number {i} asks about {w}" for i, w in
           enumerate(["rivers", "stars", "bread", "trains", "music", "glass", "salt", "wind"] * 2)]
MAX_TOKENS = 8


def _config(prefill_replicas: int) -> dict:
    return {"mode": "disaggregated", "engine": ENGINE,
            "prefill": {"num_replicas": prefill_replicas, "num_cpus": 0.25,
                        "resources": {"prefill_pool": 1}},
            "decode": {"num_replicas": 2, "num_cpus": 0.25, "resources": {"decode_pool": 1}},
            "router": {"request_timeout_s": 120}, "transfer": {"timeout_s": 10},
            "disaggregation": {"mode": "always"}}


def _gauges(deployment: str, want: int) -> dict[str, dict]:
    """Each replica's ``kv_load`` by endpoint id (Serve picks a replica per call: ask until
    ``want`` distinct replicas answered, bounded)."""
    from deploy.ray_env import driver_handle

    handle = driver_handle(deployment)
    seen: dict[str, dict] = {}
    deadline = time.time() + 60
    while len(seen) < want and time.time() < deadline:
        # Several at once: Serve spreads concurrent calls over the replicas by queue length.
        for response in [handle.kv_load.remote() for _ in range(8)]:
            load = response.result(timeout_s=30)
            seen[load["endpoint_id"]] = load
    return seen


def _until_idle(deployment: str, want: int) -> dict[str, dict]:
    deadline = time.time() + 60
    while True:
        loads = _gauges(deployment, want)
        idle = all(x["used_blocks"] == 0 and x["held_blocks"] == 0 for x in loads.values())
        if idle or time.time() > deadline:
            return loads
        time.sleep(0.5)


def _scenario(url: str, prefill_replicas: int) -> dict:
    import requests
    from ray import serve

    from deploy.app import build_app

    serve.run(build_app(_config(prefill_replicas)), name="baton", route_prefix="/")

    def post(prompt):
        r = requests.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        body = r.json()
        return {"prompt": prompt, "text": body["choices"][0]["text"],
                "transfer": body["usage"]["kv_transfer"]}

    results = []
    with ThreadPoolExecutor(4) as pool:
        # Until both decode replicas received, and (two prefill replicas) a same-node and a
        # cross-node pair were both used; bounded (8 rounds: on a loaded 2-core host, 4 rounds
        # once ended with every request on one decode replica).
        for rnd in range(8):
            results += list(pool.map(post, [f"{p} (round {rnd})" for p in PROMPTS]))
            moved = [r["transfer"] for r in results if r["transfer"] is not None]
            same = {t["src_node"] == t["dst_node"] for t in moved}
            if len({t["dst_node"] for t in moved}) == 2 and \
                    (prefill_replicas == 1 or same == {True, False}):
                break
    return {"results": results, "decode": _until_idle("DecodeServer", 2),
            "prefill": _until_idle("PrefillServer", prefill_replicas)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    sys.path.insert(0, str(ROOT))
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deploy import ray_env

    ray_env.apply()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = {"P": cluster.add_node(num_cpus=1, resources={"prefill_pool": 1}),
             "D": cluster.add_node(num_cpus=1, resources={"decode_pool": 1}),
             "C": cluster.add_node(num_cpus=1, resources={"prefill_pool": 1, "decode_pool": 1})}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        port = ray_env.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        out = {"nodes": {name: n.node_id for name, n in nodes.items()},
               "head": cluster.head_node.node_id,
               "pools": _scenario(url, prefill_replicas=2),
               "fan_in": _scenario(url, prefill_replicas=1)}
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
