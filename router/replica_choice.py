"""Replica choice with Serve's request-router API: ``KVAwareRouter``, for both pools.

The replica whose caches hold the most of the prompt, weighed against its load, comes first:
Dynamo's KV-router cost, blocks to compute (or move) plus blocks in use, with the blocks a
replica's host tier holds (``kv_offloading_size``) costing ``host_hit_cost`` of a miss (a copy
over the host link against a prefill). What each replica holds is this router's own record of
the prompts it sent there, aged by the capacities the replica reports (``record_routing_stats``):
no event stream from the engines. Each ingress replica keeps its own record; ties go in
rendezvous order of the prompt's first block, so ingress replicas without a record agree (and
prompts behind one system prompt meet on one replica until its load outweighs what it holds).
Every replica is ranked, so a full one never blocks a request; a request without prompt tokens
ranks by load alone.

Early start (``router.early_start``, ``contracts.token_channel``): just before the ingress makes
a ``generate`` call, it asks this process's router of that deployment (``early_router``) to
rank the replicas for the request now and send it to the first over that replica's token
channel (:meth:`KVAwareRouter.start_early`), unless the replica is busy
(``EARLY_START_MAX_ONGOING``); the engine there starts on it while Serve's call travels, and
when Serve asks, that replica is ranked first, so the call goes there and claims it. Should the
call land elsewhere (the replica refused it), the replica is told to withdraw it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import xxhash
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from contracts.token_channel import early_sink, register_early_router
from engine.block_pool import hash_blocks

# Early starts go only to a replica with fewer requests of this ingress in flight (and, where
# Serve's queue-length cache knows, fewer ongoing requests): under load the start would add work
# to the replica's event loop and engine while the calls queue, and the call's latency is a
# small part of the wait (a burst on the 2-core CPU host had its first tokens 50% later).
EARLY_START_MAX_ONGOING = 4
EARLY_FORGET_S = 5.0  # an early start not routed by then: its replica has dropped it


def rendezvous_order(key: int, replicas: list[RunningReplica]) -> list[RunningReplica]:
    def score(replica):
        return xxhash.xxh3_64_intdigest(f"{key}/{replica.replica_id.unique_id}".encode())
    return sorted(replicas, key=score, reverse=True)


@dataclass
class HeldBlocks:
    """This router's record of the prefix blocks it sent to one replica: each block's stamp is
    the count of blocks sent before it. The newest ``gpu`` blocks are taken to be in the
    replica's GPU cache, the ``host`` before them in its host tier, older ones gone (both caches
    evict least recently used first)."""

    stamps: dict[int, int] = field(default_factory=dict)
    clock: int = 0

    def where(self, block_hash: int, gpu: int, host: int) -> str | None:
        stamp = self.stamps.get(block_hash)
        if stamp is None:
            return None
        age = self.clock - stamp
        return "gpu" if age < gpu else "host" if age < gpu + host else None

    def add(self, hashes: list[int], capacity: int) -> None:
        for h in hashes:
            self.stamps[h] = self.clock
            self.clock += 1
        if len(self.stamps) > 2 * max(capacity, 1024):  # forget what has surely left
            oldest = self.clock - capacity
            self.stamps = {h: t for h, t in self.stamps.items() if t >= oldest}


class KVAwareRouter(RequestRouter):
    # A host-tier hit's cost over a miss's: copying a block in against computing it (8B on an
    # H100: a 16-token block's share of a 4k-token prefill 0.41 ms, its 2.36 MB over the host
    # link at 50.8 GB/s 0.046 ms).
    def initialize_state(self, block_size: int = 16, host_hit_cost: float = 0.1, **kwargs):
        self.block_size = block_size
        self.host_hit_cost = host_hit_cost
        self.held: dict = {}  # replica unique id -> HeldBlocks
        self.sent: dict = {}  # internal request id -> (replica unique id, blocks it holds)
        self.active: dict = {}  # replica unique id -> blocks of the requests in flight there
        self.requests: dict = {}  # replica unique id -> requests in flight there
        self.ended: dict = {}  # requests Serve said had completed before it said where it sent them
        self.hashed: dict = {}  # internal request id -> its prompt's block hashes, until routed
        # call's request id -> (replica unique id, sink, block hashes, when it was sent)
        self.early: dict = {}
        deployment = getattr(self, "_deployment_id", None)  # Serve's wiring only
        if deployment is not None:
            register_early_router(deployment.name, self)

    def _state(self):
        if not hasattr(self, "held"):  # tests build the policy without Serve's wiring
            self.initialize_state()
        return self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None):
        self._state()
        ranked = self._ranked(candidate_replicas, self._hashes(pending_request, keep=True) or [])
        early = self.early.get(_call_id(pending_request))
        if early is not None:  # started there (start_early): the call goes there first
            ranked.sort(key=lambda r: r.replica_id.unique_id != early[0])
        return [[r] for r in ranked]

    def _ranked(self, replicas: list[RunningReplica], hashes: list[int]) -> list[RunningReplica]:
        # Ties in rendezvous order of the first block: every ingress replica (each keeps its own
        # record) then sends a conversation nobody has a record of to the same replica.
        # Without a full block, ties are broken at random.
        order = (rendezvous_order(hashes[0], replicas) if hashes else
                 random.sample(replicas, len(replicas)))
        return sorted(order, key=lambda r: self.cost(r, hashes))

    def start_early(self, req) -> bool:
        """Just before the ingress calls ``generate`` with ``req`` (on the loop this router
        runs on): rank the replicas now and send ``req`` to the first over its token channel,
        unless it is busy (``EARLY_START_MAX_ONGOING``) or its sink takes no early starts; that
        replica is then ranked first for the call. Whether it was sent."""
        self._state()
        sink = early_sink(getattr(req, "reply_to", None))
        replicas = list(getattr(self, "_replicas", {}).values())
        if sink is None or not replicas or req.request_id in self.early:
            return False
        hashes = hash_blocks(req.prompt_token_ids, self.block_size)
        first = self._ranked(replicas, hashes)[0]
        uid = first.replica_id.unique_id
        cache = getattr(self, "_replica_queue_len_cache", None)  # Serve's wiring only
        queued = cache.get(first.replica_id) if cache is not None else None
        now = time.monotonic()
        # One copy: where Serve runs the router on a loop of its own, on_request_routed may pop
        # an entry meanwhile. Calls cancelled before routing leave theirs: forgotten here.
        entries = list(self.early.items())
        for call_id, (*_, sent_at) in entries:
            if sent_at < now - EARLY_FORGET_S:
                self.early.pop(call_id, None)
        starting = sum(1 for _, (to, *_, sent_at) in entries
                       if to == uid and sent_at >= now - EARLY_FORGET_S)
        if max(queued or 0, self.requests.get(uid, 0) + starting) >= EARLY_START_MAX_ONGOING:
            return False  # a busy replica: the call starts it, as without early starts
        if not sink.submit(uid, req):
            return False  # not connected yet (its first request from this ingress)
        self.early[req.request_id] = (uid, sink, hashes, now)
        return True

    def withdraw_early(self, request_id: str) -> None:
        """The sender of an early start will not call after all (a hand-over sent ahead of
        its reservation, which found no room): its replica drops it now."""
        early = self.early.pop(request_id, None)
        if early is not None:
            early[1].withdraw(early[0], request_id)

    def cost(self, replica: RunningReplica, hashes: list[int]) -> float:
        """Blocks ``replica`` would compute or receive for the prompt, host-tier hits at
        ``host_hit_cost`` each, plus the blocks in use there (the larger of what it last
        reported and what this router has sent it)."""
        gpu, host = capacity(replica)
        held = self.held.get(replica.replica_id.unique_id)
        on_gpu = on_host = 0
        for h in hashes if held is not None else ():
            place = held.where(h, gpu, host)
            if place is None:
                break
            if place == "gpu" and not on_host:  # the engine's lookup: GPU run, then host tier
                on_gpu += 1
            else:
                on_host += 1
        missing = len(hashes) - on_gpu - on_host
        used = max(kv_load(replica) * gpu, self.active.get(replica.replica_id.unique_id, 0))
        return missing + self.host_hit_cost * on_host + used

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._state()
        self._routed_early(_call_id(pending_request), replica_id.unique_id)
        hashes = self._hashes(pending_request, keep=False)
        if hashes is None:
            return
        rid = replica_id.unique_id
        replicas = self.curr_replicas if hasattr(self, "_replicas") else {}
        gpu, host = capacity(replicas[replica_id]) if replica_id in replicas else (0, 0)
        self.held.setdefault(rid, HeldBlocks()).add(hashes, gpu + host)
        request_id = _request_id(pending_request)
        if self.ended.pop(request_id, False):  # Serve may report the end first
            return
        blocks = len(_prompt_tokens(pending_request)) // self.block_size + 1
        self.active[rid] = self.active.get(rid, 0) + blocks
        if request_id is not None:
            self.requests[rid] = self.requests.get(rid, 0) + 1
            self.sent[request_id] = (rid, blocks)

    def _routed_early(self, call_id: str | None, replica: str) -> None:
        early = self.early.pop(call_id, None)
        if early is not None and early[0] != replica:  # the call went elsewhere
            early[1].withdraw(early[0], call_id)

    def _hashes(self, pending_request, keep: bool) -> list[int] | None:
        """The chained hashes of the prompt's full blocks, as the engines' prefix caches key
        them (None without prompt tokens): computed once a request, kept from
        :meth:`choose_replicas` (``keep``) to :meth:`on_request_routed`."""
        request_id = _request_id(pending_request)
        if request_id in self.hashed:
            return self.hashed[request_id] if keep else self.hashed.pop(request_id)
        tokens = _prompt_tokens(pending_request)
        early = self.early.get(_call_id(pending_request))
        hashes = early[2] if early is not None else \
            None if tokens is None else hash_blocks(tokens, self.block_size)
        if keep and request_id is not None:
            self.hashed[request_id] = hashes
            while len(self.hashed) > 4096:  # requests chosen for but never routed
                self.hashed.pop(next(iter(self.hashed)))
        return hashes

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._state()
        rid, blocks = self.sent.pop(internal_request_id, (None, 0))
        if rid is not None:
            if rid in self.active:  # (not a replica forgotten since: no record made again)
                self.active[rid] = max(0, self.active[rid] - blocks)
            if rid in self.requests:
                self.requests[rid] = max(0, self.requests[rid] - 1)
        else:
            self.ended[internal_request_id] = True
            while len(self.ended) > 4096:  # ends of requests never routed with tokens
                self.ended.pop(next(iter(self.ended)))

    def on_replica_actor_died(self, replica_id) -> None:
        self._state()
        self._forget_replicas({replica_id.unique_id})
        super().on_replica_actor_died(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of replicas (a scale-down, a redeploy, a replacement): the records of
        those no longer in it go (each replica's held blocks are up to twice its cache)."""
        self._state()
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self._forget_replicas({uid for d in (self.held, self.active, self.requests)
                               for uid in d if uid not in live})

    def _forget_replicas(self, uids: set[str]) -> None:
        for uid in uids:
            self.held.pop(uid, None)
            self.active.pop(uid, None)
            self.requests.pop(uid, None)


def capacity(replica: RunningReplica) -> tuple[int, int]:
    """The GPU and host-tier blocks ``replica`` reported (0 until it has)."""
    stats = replica.routing_stats or {}
    return int(stats.get("kv_blocks", 0)), int(stats.get("kv_host_blocks", 0))


def kv_load(replica: RunningReplica) -> float:
    stats = replica.routing_stats or {}
    return float(stats.get("kv_used_fraction", 0.0))


def _request_id(pending_request: PendingRequest | None) -> str | None:
    return getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)


def _call_id(pending_request: PendingRequest | None) -> str | None:
    """The ``generate`` call's own request id (``GenerateRequest.request_id``), if it is one."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "request_id", None)


def _prompt_tokens(pending_request: PendingRequest | None):
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "prompt_token_ids", None)
