"""Replica choice for both pools: what each replica's caches hold (GPU, then host tier) against
its load."""

import asyncio
from collections import namedtuple

import pytest
from types import SimpleNamespace

from engine.block_pool import hash_blocks
from router.replica_choice import KVAwareRouter


ReplicaID = namedtuple("ReplicaID", "unique_id")  # hashable, as Serve's is


def _replica(name, kv=0.0, blocks=1000, host_blocks=0):
    return SimpleNamespace(replica_id=ReplicaID(name),
                           routing_stats={"kv_used_fraction": kv, "kv_blocks": blocks,
                                          "kv_host_blocks": host_blocks})


def _pending(tokens):
    return SimpleNamespace(args=[SimpleNamespace(prompt_token_ids=tuple(tokens))])


def _choose(router_cls, replicas, pending, **state):
    router = router_cls.__new__(router_cls)  # the routing policy alone, without Serve's wiring
    for k, v in state.items():
        setattr(router, k, v)
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_shared_first_block_goes_to_the_same_replica_and_others_spread():
    """With nothing recorded yet, ties go in rendezvous order of the first block: prompts
    behind one system prompt meet on one replica, others spread; every replica is ranked."""
    replicas = [_replica(f"r{i}") for i in range(4)]
    system = list(range(100, 116))  # one shared 16-token block
    firsts = {_choose(KVAwareRouter, replicas, _pending(system + [i, i + 1]))[0][0]
              .replica_id.unique_id for i in range(20)}
    assert len(firsts) == 1
    spread = {_choose(KVAwareRouter, replicas, _pending([i] * 20))[0][0].replica_id.unique_id
              for i in range(40)}
    assert len(spread) > 1
    ranks = _choose(KVAwareRouter, replicas[:3], _pending(range(40)))
    assert sorted(r[0].replica_id.unique_id for r in ranks) == ["r0", "r1", "r2"]


def test_least_kv_load_first_without_a_prompt():
    replicas = [_replica("busy", 0.9), _replica("idle", 0.1), _replica("mid", 0.5)]
    ranks = _choose(KVAwareRouter, replicas, None)
    assert [r[0].replica_id.unique_id for r in ranks] == ["idle", "mid", "busy"]


class _Routed:
    """A KVAwareRouter fed as Serve feeds it: rank, then the request routed to the first."""

    def __init__(self, replicas, block_size=16):
        self.router = KVAwareRouter.__new__(KVAwareRouter)
        self.router.initialize_state(block_size=block_size)
        self.replicas = replicas
        self.count = 0

    def send(self, tokens, to=None) -> str:
        pending = _pending(tokens)
        pending.metadata = SimpleNamespace(internal_request_id=f"q{self.count}")
        self.count += 1
        ranked = asyncio.run(self.router.choose_replicas(self.replicas, pending))
        chosen = to or ranked[0][0]
        self.router._replicas = {r.replica_id: r for r in self.replicas}
        self.router.on_request_routed(pending, chosen.replica_id, None)
        return ranked[0][0].replica_id.unique_id

    def done(self, number: int) -> None:
        self.router.on_request_completed(None, f"q{number}")


def test_a_returning_prompt_goes_where_its_blocks_are():
    """A conversation's next turn (its history plus a new message) goes to the replica that
    served the last turn, even where another replica is a little less loaded; a prompt nobody
    holds goes to the least loaded replica."""
    a, b = _replica("a", kv=0.005), _replica("b", kv=0.0)  # a: 5 blocks in use
    routed = _Routed([a, b])
    history = list(range(1000, 1000 + 16 * 20))  # 20 full blocks
    routed.send(history, to=a)
    routed.done(0)
    assert routed.send(history + list(range(7, 40))) == "a"
    routed.done(1)
    assert routed.send(list(range(5000, 5000 + 16 * 20))) == "b"


def test_host_tier_hits_count_at_a_fraction_of_a_miss():
    """Blocks pushed out of a replica's GPU cache by later prompts are still held by its host
    tier: they count as cheap hits there, and as misses on a replica without a tier."""
    history = list(range(1000, 1000 + 16 * 20))
    for host_blocks, want in ((1000, "a"), (0, "b")):
        a, b = _replica("a", kv=0.01, blocks=40, host_blocks=host_blocks), _replica("b", blocks=40)
        routed = _Routed([a, b])
        routed.send(history, to=a)
        for i in range(3):  # 60 newer blocks: more than a's GPU cache holds
            routed.send(list(range(9000 + 1000 * i, 9000 + 1000 * i + 16 * 20)), to=a)
        for n in range(4):
            routed.done(n)
        held = routed.router.held["a"]
        hashes = hash_blocks(history, 16)
        assert {held.where(h, 40, host_blocks) for h in hashes} == {"host" if host_blocks else None}
        # 20 blocks at a tenth of a miss each (or 20 misses), plus a's load (1% of 40 blocks)
        assert routed.router.cost(a, hashes) == pytest.approx((2 if host_blocks else 20) + 0.4)
        assert routed.send(history + [1, 2, 3]) == want


def test_load_outweighs_a_small_overlap_and_finished_requests_free_it():
    a, b = _replica("a"), _replica("b")
    routed = _Routed([a, b])
    shared = list(range(100, 116))  # one shared block
    routed.send(shared + [1] * 16 * 30, to=a)  # 31 blocks in flight on a
    assert routed.send(shared + [2] * 16) == "b"  # one block of overlap does not pay for 31
    routed.done(0)
    routed.done(1)
    assert routed.router.active == {"a": 0, "b": 0}
    assert routed.send(shared + [1] * 32) == "a"  # idle again: the overlap (3 blocks to 1) decides
    routed.router.on_request_completed(None, "q3")  # Serve may report the end first
    routed.send(shared + [4] * 16, to=b)  # that is q3
    assert routed.router.active == {"a": 4, "b": 0} and not routed.router.ended  # q2 still on a
    assert not routed.router.hashed  # each request's hashes, kept from choice to routing only


def test_both_roles_report_what_the_router_reads():
    """A role replica's routing stats come from its engine's latest snapshot: the fraction of
    KV blocks in use, and the blocks its GPU cache and its host tier hold."""
    from contracts.role import RoleDeployment
    from engine.snapshot import EngineSnapshot

    role = RoleDeployment()
    snap = EngineSnapshot(kv_blocks_used=30, kv_blocks_free=90, host_blocks_used=5,
                          host_blocks_free=395)
    role.server = SimpleNamespace(aengine=SimpleNamespace(feed=SimpleNamespace(latest=snap)))
    try:
        assert role.record_routing_stats() == {"kv_used_fraction": 0.25, "kv_blocks": 120,
                                               "kv_host_blocks": 400}
    finally:
        role.server = None  # nothing to close


# -- early starts: the request sent to the first-ranked replica ahead of Serve's call ---------
class _EarlySink:
    """Stands in for an early-start token sink of this process (what it was asked to send;
    ``connected``: the replicas whose token channels are open)."""

    def __init__(self, monkeypatch, connected=("busy", "idle")):
        self.sent, self.withdrawn, self.connected = [], [], connected
        # the router's own module globals (an earlier test may have imported the module anew)
        monkeypatch.setitem(KVAwareRouter.start_early.__globals__, "early_sink",
                            lambda address: self if address == "sink" else None)

    def submit(self, uid, req):
        self.sent.append((uid, req.request_id))
        return uid in self.connected

    def withdraw(self, uid, request_id):
        self.withdrawn.append((uid, request_id))


def _call(call_id, tokens=range(40), reply_to="sink"):
    """A ``generate`` call's request and the pending request Serve makes of it."""
    req = SimpleNamespace(prompt_token_ids=tuple(tokens), request_id=call_id, reply_to=reply_to)
    return req, SimpleNamespace(args=[req], metadata=SimpleNamespace(
        internal_request_id=f"internal-{call_id}"))


def _early_router(replicas):
    router = KVAwareRouter.__new__(KVAwareRouter)
    router.initialize_state()
    router._replicas = {r.replica_id: r for r in replicas}
    return router


def test_an_early_start_goes_to_the_first_replica_and_its_call_follows_it(monkeypatch):
    """The ingress's early start goes to the replica ranked first, once a call; Serve's call is
    then ranked to that replica first even if the ranking has changed meanwhile; a call routed
    there claims it (no withdrawal), one routed elsewhere withdraws it."""
    sink = _EarlySink(monkeypatch)
    replicas = [_replica("busy", 0.9), _replica("idle", 0.1)]
    router = _early_router(replicas)
    for call_id, routed_to in (("c0", replicas[1]), ("c1", replicas[0])):
        req, pending = _call(call_id)
        assert router.start_early(req) and not router.start_early(req)  # once a call
        replicas[1].routing_stats["kv_used_fraction"] = 0.95  # "idle" got busy meanwhile
        ranked = asyncio.run(router.choose_replicas(replicas, pending))
        assert ranked[0][0].replica_id.unique_id == "idle"
        router.on_request_routed(pending, routed_to.replica_id, None)
        replicas[1].routing_stats["kv_used_fraction"] = 0.1
    assert sink.sent == [("idle", "c0"), ("idle", "c1")]
    assert sink.withdrawn == [("idle", "c1")] and router.early == {}
    _, pending = _call("c2")  # no early start: ranked as ever
    assert asyncio.run(router.choose_replicas(replicas, pending))[0][0].replica_id.unique_id \
        == "idle"
    # A sender whose call will not follow (a hand-over sent ahead of a reservation that found
    # no room) withdraws it from the replica it went to; a second withdrawal does nothing.
    req, _ = _call("c3")
    assert router.start_early(req)
    router.withdraw_early("c3")
    router.withdraw_early("c3")
    assert sink.withdrawn[-1] == ("idle", "c3") and len(sink.withdrawn) == 2
    assert router.early == {}


@pytest.mark.parametrize("case", ["no early-start sink", "busy by Serve's count",
                                  "busy by this router's count", "not connected"])
def test_no_early_start_where_it_cannot_be_claimed_or_would_add_to_a_busy_replica(monkeypatch,
                                                                                  case):
    from router.replica_choice import EARLY_START_MAX_ONGOING

    sink = _EarlySink(monkeypatch, connected=() if case == "not connected" else ("only",))
    replica = _replica("only")
    router = _early_router([replica])
    router._replica_queue_len_cache = SimpleNamespace(
        get=lambda rid: EARLY_START_MAX_ONGOING if case == "busy by Serve's count" else None)
    for i in range(EARLY_START_MAX_ONGOING - 1):  # requests in flight there, one short of busy
        req, pending = _call(f"before{i}")
        router.on_request_routed(pending, replica.replica_id, None)
    if case == "busy by this router's count":  # one more, started early, its call not routed
        assert router.start_early(_call("last")[0])
    req, _ = _call("c", reply_to=None if case == "no early-start sink" else "sink")
    assert not router.start_early(req) and "c" not in router.early
    assert ("only", "c") in sink.sent if case == "not connected" else ("only", "c") not in sink.sent
    if case == "busy by this router's count":
        import time

        uid, early_sink, hashes, _ = router.early["last"]  # its call never came (cancelled)
        router.early["last"] = (uid, early_sink, hashes, time.monotonic() - 10)
        assert router.start_early(req) and "last" not in router.early  # forgotten: room again
    router.on_request_completed(None, "internal-before0")  # one ends: room by this count
    assert router.start_early(_call("d", reply_to=req.reply_to)[0]) == \
        (case == "busy by this router's count")


def test_a_retired_replicas_records_go_with_it(monkeypatch):
    """Serve's new set of replicas without one (a scale-down or a redeploy, not a death): the
    router forgets what it kept of that replica (its held blocks, up to twice its cache; its
    requests in flight), and a late completion of a request sent there does not bring the
    record back."""
    from ray.serve._private.request_router.request_router import RequestRouter

    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    a, b = _replica("a"), _replica("b")
    routed = _Routed([a, b])
    routed.send(list(range(100, 164)), to=a)
    routed.send(list(range(200, 264)), to=b)
    assert set(routed.router.held) == set(routed.router.active) == {"a", "b"}
    routed.router.update_replicas([b])
    assert set(routed.router.held) == set(routed.router.active) == {"b"}
    assert set(routed.router.requests) == {"b"}
    routed.done(0)  # the request sent to a ends after a was retired
    assert set(routed.router.active) == set(routed.router.requests) == {"b"}
    routed.done(1)
    assert routed.router.active == {"b": 0} and routed.router.requests == {"b": 0}
