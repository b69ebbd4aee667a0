"""Baton on a multi-node local Ray cluster (``tests/multinode.py``, run in a process of its own
so that it gets a Ray cluster of its own): prefill and decode replicas pinned to node pools by
Ray resources, the transport chosen per replica pair from the nodes (NIXL for every pair on
CPU), the offline engine's tokens, every replica's KV gauges back to idle, and every prefill
replica's link to every decode replica warmed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from kvtransfer import default_backend
from tests.multinode import MAX_TOKENS

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode") / "result.json"
    proc = subprocess.run([sys.executable, "-m", "tests.multinode", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def offline():
    llm = LLM("tiny")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return lambda prompt: llm.generate([prompt], params)[0].text


def _check(scenario: dict, offline) -> set[tuple[str, str]]:
    """Tokens, transports and idle gauges of one scenario; the (sender, receiver) node pairs."""
    pairs = set()
    for r in scenario["results"]:
        assert r["text"] == offline(r["prompt"]), r["prompt"]
        t = r["transfer"]
        assert t is not None and t["blocks_sent"] > 0, r  # prefilled on a prefill replica
        assert t["backend"] == default_backend(t["src_node"] == t["dst_node"], "cpu") == "nixl"
        pairs.add((t["src_node"], t["dst_node"]))
    for role in ("decode", "prefill"):
        for load in scenario[role].values():
            assert load["used_blocks"] == 0 and load["held_blocks"] == 0, (role, load)
    # Every prefill replica warmed its link to every decode replica, on its node or across.
    for load in scenario["prefill"].values():
        for decode_id in scenario["decode"]:
            assert load["links"].get(decode_id, {}).get("state") == "warm", load["links"]
    return pairs


def test_node_pools_pin_the_roles_and_every_pair_hands_over(run, offline):
    nodes, pools = run["nodes"], run["pools"]
    decode_nodes = {x["node_id"] for x in pools["decode"].values()}
    prefill_nodes = {x["node_id"] for x in pools["prefill"].values()}
    assert decode_nodes == {nodes["D"], nodes["C"]}, (nodes, pools["decode"])
    assert prefill_nodes == {nodes["P"], nodes["C"]}, (nodes, pools["prefill"])
    pairs = _check(pools, offline)
    assert (nodes["C"], nodes["C"]) in pairs, (nodes, pairs)  # the pair on one node
    assert any(src != dst for src, dst in pairs)  # and pairs across nodes


def test_one_prefill_replica_feeds_decode_replicas_on_two_nodes(run, offline):
    fan_in = run["fan_in"]
    assert len(fan_in["prefill"]) == 1
    pairs = _check(fan_in, offline)
    assert len({src for src, _ in pairs}) == 1
    assert {dst for _, dst in pairs} == {x["node_id"] for x in fan_in["decode"].values()}
    assert len({dst for _, dst in pairs}) == 2
