"""Replica choice with Serve's request-router API.

- ``PrefixAwareRouter`` (prefill): requests whose first KV block is the same prefer the same
  replica (rendezvous hashing over replica ids), so that replica's prefix cache holds the blocks
  they share; the other replicas follow as fallbacks, so a busy replica never blocks a request.
- ``LeastKVLoadRouter`` (decode): the replica with the smallest fraction of KV blocks in use (as
  reported by ``record_routing_stats``) first.
"""

from __future__ import annotations

import random

import xxhash
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from engine.block_pool import hash_block


def prefix_key(token_ids, block_size: int) -> int:
    """The chained hash of the prompt's first block (of the whole prompt when shorter)."""
    return hash_block(None, list(token_ids[:block_size]))


def rendezvous_order(key: int, replicas: list[RunningReplica]) -> list[RunningReplica]:
    def score(replica):
        return xxhash.xxh3_64_intdigest(f"{key}/{replica.replica_id.unique_id}".encode())
    return sorted(replicas, key=score, reverse=True)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, **kwargs):
        self.block_size = block_size

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None):
        tokens = _prompt_tokens(pending_request)
        if not candidate_replicas or tokens is None:
            return [candidate_replicas]
        ranked = rendezvous_order(prefix_key(tokens, getattr(self, "block_size", 16)),
                                  candidate_replicas)
        return [[r] for r in ranked]


class LeastKVLoadRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None):
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))  # fair ties
        ranked = sorted(shuffled, key=kv_load)
        return [[r] for r in ranked]


def kv_load(replica: RunningReplica) -> float:
    stats = replica.routing_stats or {}
    return float(stats.get("kv_used_fraction", 0.0))


def _prompt_tokens(pending_request: PendingRequest | None):
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "prompt_token_ids", None)
