"""A replica's KV endpoints, one per tensor-parallel rank, driven as one.

Every rank of a replica holds the same block ids (one block table, on rank 0) and its own slice
of the model's KV heads (``KVLayout.heads``). The ranks' caches are all reachable from rank 0's
process (worker ranks share theirs: ``engine.tp_ranks``), so rank 0 holds one
:class:`~kvtransfer.endpoint.KVEndpoint` per rank and this class drives them together.

A push from a replica of p ranks to one of d ranks writes, for each sender rank and receiver
rank that share heads, those heads of the request's blocks: whole blocks when both hold the same
heads (p = d, rank to rank), otherwise each rank pair its part of them (p > d: several senders
write into one receiver rank's blocks; p < d: one sender writes into several). Each of these is a
transfer of its own; the replica's transfer is DONE only when every part is, and FAILED if any
part fails. On the sending side the source blocks are leased until every part is terminal, so
they are released only when every receiving rank has its part or no part can still write. On
the receiving side each rank's transfer lands once every one of its heads has landed; a rank
whose transfer fails (deadline, abort) ends the others, so the whole hand-over fails and the
owner releases the blocks of every rank at once (they are the same block ids).

The layout check (:func:`kvtransfer.types.check_compatible`) compares the model layout and both
tensor-parallel sizes, for every rank pair, before any byte moves. With one rank on each side
this is a plain endpoint: its transfers are the rank's own.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtransfer.endpoint import WARM_TIMEOUT_S, KVEndpoint, Transfer
from kvtransfer.types import (PROTOCOL_VERSION, WARM_PREFIX, EndpointInfo, HeadSlice,
                              KVDestination, TransferState, TransferStats, check_compatible,
                              head_slice)


class _Joined:
    """A replica's transfer made of rank transfers (its parts)."""

    __slots__ = ("whole", "parts", "left", "error")

    def __init__(self, whole: Transfer, count: int):  # count: the parts, plus their making
        self.whole = whole
        self.parts: list[tuple[KVEndpoint, Transfer]] = []
        self.left = count
        self.error: str | None = None


class ReplicaEndpoint:
    def __init__(self, ranks: Sequence[KVEndpoint]):
        if not ranks:
            raise ValueError("a replica endpoint needs at least one rank")
        self.ranks = list(ranks)
        self._lock = threading.Lock()
        self._joined: dict[str, _Joined] = {}
        self._info: EndpointInfo | None = None

    # -- what rank 0 says for the replica ----------------------------------------------------
    @property
    def endpoint_id(self) -> str:
        return self.ranks[0].endpoint_id

    @property
    def node_id(self) -> str:
        return self.ranks[0].node_id

    @property
    def layout(self):
        return self.ranks[0].layout

    @property
    def backends(self):
        return self.ranks[0].backends

    @property
    def kv_cache(self):
        return self.ranks[0].kv_cache

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def info(self) -> EndpointInfo:
        """Rank 0's endpoint, naming the replica, with every rank's (one rank: its own)."""
        if len(self.ranks) == 1:
            return self.ranks[0].info()
        if self._info is None:
            self._info = replace(self.ranks[0].info(),
                                 ranks=tuple(r.info() for r in self.ranks))
        return self._info

    def choose(self, peer: EndpointInfo) -> str:
        """The backend a push to ``peer`` uses (the ranks of a replica share a node)."""
        return self.ranks[0].choose(peer)

    def native_notify(self, backend: str) -> bool:
        return self.ranks[0].native_notify(backend)

    @property
    def receiver_writes(self) -> bool:
        return all(r.receiver_writes for r in self.ranks)

    @property
    def held_blocks(self) -> int:
        """Blocks under lease: the most any rank holds (every rank leases the same block ids; a
        sender rank writing to several receiver ranks leases them once per part)."""
        return max(r.held_blocks for r in self.ranks)

    @property
    def busy(self) -> bool:
        return any(r.busy for r in self.ranks)

    def poll(self, settle: bool = False) -> bool:
        for r in self.ranks:
            r.poll(settle)
        return self.busy

    wait = KVEndpoint.wait

    # -- sender ------------------------------------------------------------------------------
    def plan(self, peer: EndpointInfo) -> list[tuple[KVEndpoint, EndpointInfo, HeadSlice | None]]:
        """``(sender rank, receiver rank, heads)`` for every rank pair that shares heads
        (``heads`` None: the same heads, whole blocks). Raises ``LayoutMismatchError`` before
        anything moves."""
        pairs = []
        for rank in self.ranks:
            for other in peer.rank_infos:
                check_compatible(rank.layout, other.layout, PROTOCOL_VERSION,
                                 other.protocol_version)
                heads = head_slice(rank.layout, other.layout)
                if heads is not None:
                    same = rank.layout.heads == other.layout.heads
                    pairs.append((rank, other, None if same else heads))
        return pairs

    def push(self, peer: EndpointInfo, dest: KVDestination, src_block_ids: Sequence[int],
             on_finish: Callable[[Transfer], None] | None = None) -> Transfer:
        """Write what ``dest`` lacks into the replica ``peer`` (``KVEndpoint.push``), every
        rank its heads."""
        pairs = self.plan(peer)
        if len(pairs) == 1:
            rank, other, heads = pairs[0]
            return rank.push(other, replace(dest, endpoint_id=other.endpoint_id), src_block_ids,
                             on_finish, heads)
        first = pairs[0][0]
        whole = Transfer(dest.transfer_id, "send", first.choose(peer), (), dest.deadline,
                         TransferStats(), on_finish, peer.endpoint_id)
        joined = self._join(whole, len(pairs))
        done = self._part_done(joined, abort_others=False)
        for rank, other, heads in pairs:
            part = rank.push(other, replace(dest, endpoint_id=other.endpoint_id), src_block_ids,
                             done, heads)
            joined.parts.append((rank, part))
        self._settle(joined)
        return whole

    def warm(self, peer: EndpointInfo, on_finish: Callable[[Transfer], None] | None = None,
             timeout_s: float = WARM_TIMEOUT_S) -> Transfer:
        """``KVEndpoint.warm`` for every rank pair a push to ``peer`` uses."""
        dest = KVDestination(f"{WARM_PREFIX}{uuid.uuid4().hex[:8]}", peer.endpoint_id, (0,), 0,
                             time.time() + timeout_s)
        return self.push(peer, dest, (0,), on_finish)

    # -- receiver ----------------------------------------------------------------------------
    def expect(self, dest: KVDestination,
               on_finish: Callable[[Transfer], None] | None = None) -> Transfer:
        """Lease ``dest.block_ids`` on every rank until each rank has every head."""
        if len(self.ranks) == 1:
            return self.ranks[0].expect(dest, on_finish)
        whole = Transfer(dest.transfer_id, "recv", "", tuple(dest.block_ids), dest.deadline,
                         TransferStats(), on_finish)
        whole.update(TransferState.IN_FLIGHT)
        joined = self._join(whole, len(self.ranks))
        done = self._part_done(joined, abort_others=True)
        for rank in self.ranks:
            part = rank.expect(replace(dest, endpoint_id=rank.endpoint_id), done)
            joined.parts.append((rank, part))
        if joined.error is not None:  # a part failed while the others were being made
            self._abort_parts(joined, joined.error)
        self._settle(joined)
        return whole

    def mark_landed(self, transfer_id: str) -> None:
        """The control plane's word that every part has landed (backends without
        notifications)."""
        joined = self._joined.get(transfer_id)
        if joined is None:
            self.ranks[0].mark_landed(transfer_id)
            return
        for rank, part in list(joined.parts):
            rank.mark_landed(part.transfer_id)

    def abort(self, transfer_id: str, reason: str = "aborted") -> None:
        joined = self._joined.get(transfer_id)
        if joined is None:
            self.ranks[0].abort(transfer_id, reason)
        else:
            self._abort_parts(joined, reason)

    def close(self) -> None:
        for r in self.ranks:
            r.close()

    # -- joining the parts -------------------------------------------------------------------
    def _join(self, whole: Transfer, count: int) -> _Joined:
        """Track ``whole``'s ``count`` parts; it ends once they have ended and :meth:`_settle`
        says they all exist (its last ``_settle``: a part may end while it is being made)."""
        joined = _Joined(whole, count + 1)
        with self._lock:
            self._joined[whole.transfer_id] = joined
        return joined

    def _settle(self, joined: _Joined, part: Transfer | None = None) -> bool:
        """One more part (or the making of them) has ended; returns whether ``part`` is the
        first to fail. Ends the whole transfer after the last."""
        with self._lock:
            joined.left -= 1
            first_failure = (part is not None and part.state is TransferState.FAILED
                             and joined.error is None)
            if first_failure:
                joined.error = part.error or "failed"
            last = joined.left == 0
            if last:
                self._joined.pop(joined.whole.transfer_id, None)
        if last:
            _finish_whole(joined)
        return first_failure and not last

    def _part_done(self, joined: _Joined, abort_others: bool) -> Callable[[Transfer], None]:
        def done(part: Transfer) -> None:  # the thread that ended the part, once per part
            if self._settle(joined, part) and abort_others:
                self._abort_parts(joined, f"another rank's part failed: {joined.error}")
        return done

    @staticmethod
    def _abort_parts(joined: _Joined, reason: str) -> None:
        for rank, part in list(joined.parts):
            if not part.state.is_terminal:
                rank.abort(part.transfer_id, reason)


def _finish_whole(joined: _Joined) -> None:
    whole, parts = joined.whole, [p for _, p in joined.parts]
    st = whole.stats
    for part in parts:
        st.bytes += part.stats.bytes
        st.descriptors += part.stats.descriptors
    if parts:
        first = parts[0].stats
        st.blocks_sent, st.blocks_skipped = first.blocks_sent, first.blocks_skipped
        st.backend, st.src_node, st.dst_node = first.backend, first.src_node, first.dst_node
        whole.blocks = parts[0].blocks
    started = [p.handle for p in parts if p.handle is not None]
    whole.handle = started or None  # None: no part started writing (nothing was written)
    if whole.role == "send" and whole.state is TransferState.PENDING:
        whole.update(TransferState.IN_FLIGHT)
    whole.update(TransferState.FAILED if joined.error is not None else TransferState.DONE,
                 joined.error)
