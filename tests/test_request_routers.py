"""Replica choice: prefix affinity for prefill, least KV load for decode."""

import asyncio
from types import SimpleNamespace

from router.replica_choice import LeastKVLoadRouter, PrefixAwareRouter


def _replica(name, kv=0.0):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name),
                           routing_stats={"kv_used_fraction": kv})


def _pending(tokens):
    return SimpleNamespace(args=[SimpleNamespace(prompt_token_ids=tuple(tokens))])


def _choose(router_cls, replicas, pending, **state):
    router = router_cls.__new__(router_cls)  # the routing policy alone, without Serve's wiring
    for k, v in state.items():
        setattr(router, k, v)
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_shared_first_block_goes_to_the_same_replica_and_others_spread():
    replicas = [_replica(f"r{i}") for i in range(4)]
    system = list(range(100, 116))  # one shared 16-token block
    firsts = {_choose(PrefixAwareRouter, replicas, _pending(system + [i, i + 1]),
                      block_size=16)[0][0].replica_id.unique_id for i in range(20)}
    assert len(firsts) == 1
    spread = {_choose(PrefixAwareRouter, replicas, _pending([i] * 20),
                      block_size=16)[0][0].replica_id.unique_id for i in range(40)}
    assert len(spread) > 1


def test_prefix_ranking_keeps_every_replica_as_a_fallback():
    replicas = [_replica(f"r{i}") for i in range(3)]
    ranks = _choose(PrefixAwareRouter, replicas, _pending(range(40)), block_size=16)
    assert sorted(r[0].replica_id.unique_id for r in ranks) == ["r0", "r1", "r2"]
    assert _choose(PrefixAwareRouter, replicas, None, block_size=16) == [replicas]


def test_least_kv_load_first():
    replicas = [_replica("busy", 0.9), _replica("idle", 0.1), _replica("mid", 0.5)]
    ranks = _choose(LeastKVLoadRouter, replicas, None)
    assert [r[0].replica_id.unique_id for r in ranks] == ["idle", "mid", "busy"]
