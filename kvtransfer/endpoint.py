"""A KV endpoint: one engine's cache registered with its transports, in both roles.

An endpoint serves one backend, or for ``auto`` every backend a pair may need (CUDA IPC and
NIXL on a GPU): the sender chooses one per receiver at each push, from both endpoints' node and
device (:func:`kvtransfer.backends.choose_backend`).

Sender side (prefill): :meth:`KVEndpoint.push` checks the peer's layout and picks the
transport, then starts writing only the blocks the receiver lacks. Receiver side (decode):
:meth:`KVEndpoint.expect` leases the destination blocks until the data lands (DONE), the
deadline passes or the transfer is aborted (FAILED). :meth:`KVEndpoint.poll` moves every transfer forward; each transfer's
``on_finish`` callback runs exactly once, when it first becomes terminal, and is where the owner
returns or hands over its leased blocks. ``held_blocks`` counts blocks under lease.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import copy_blocks
from kvtransfer.backends import choose_backend, create_backends
from kvtransfer.backends.base import TransportBackend
from kvtransfer.types import (PROTOCOL_VERSION, WARM_PREFIX, EndpointInfo, HeadSlice,
                              KVDestination, KVLayout, LayoutMismatchError, TransferError,
                              TransferState, TransferStats, advance, check_compatible, is_warm,
                              part_id, split_part)

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.0005
SPIN_S = 0.005
# A receiver gives up a little after the deadline, so that the sender (which starts no write
# after the deadline) has given up first.
RECV_GRACE_S = 0.25
# A write still in flight at its deadline cannot be taken back (a CUDA copy runs to its end;
# NIXL may refuse to release an active transfer): the sender keeps it, and its source blocks,
# until the transport says it has ended, for at most this long past the deadline, and fails the
# push only then. So a push's end, and the prefill replica's answer, mean that nothing writes
# any more; a receiver that gave up meanwhile keeps its blocks out of use until that answer
# (``decode_worker.handover``: fenced), for at most as long.
DRAIN_MAX_S = 5.0

WARM_TIMEOUT_S = 60.0
LANDED_EARLY_MAX = 4096  # unclaimed landings kept (a landing's transfer comes within ms)


def late_write_bound_s() -> float:
    """How long a receiver keeps a lease's blocks fenced after giving it up: the sender's
    longest drain past the deadline plus the receiver's grace, which covers the last write's
    landing with room to spare (read at call time, so a shorter ``DRAIN_MAX_S`` applies)."""
    return DRAIN_MAX_S + RECV_GRACE_S


@dataclass
class Transfer:
    transfer_id: str
    role: str  # "send" or "recv"
    backend: str  # the transport it uses ("" for a receive: the sender chooses)
    blocks: tuple[int, ...]  # the local blocks under lease
    deadline: float
    stats: TransferStats
    on_finish: Callable[["Transfer"], None] | None = None
    peer_id: str = ""
    handle: Any = None
    # A receive: the model's KV heads not landed yet (a tensor-parallel rank may be written by
    # several senders, each its part of the heads).
    missing: set[int] = field(default_factory=set)
    state: TransferState = TransferState.PENDING
    error: str | None = None
    started: float = field(default_factory=time.perf_counter)

    def update(self, new: TransferState, error: str | None = None) -> bool:
        """Move forward; return True when this call made the transfer terminal."""
        was_terminal = self.state.is_terminal
        self.state = advance(self.state, new)
        if new is TransferState.FAILED and self.error is None:
            self.error = error or "failed"
        if self.state.is_terminal and not was_terminal:
            self.stats.seconds = time.perf_counter() - self.started
            if self.on_finish is not None:
                self.on_finish(self)
            return True
        return False


class KVEndpoint:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, backend: str = "local",
                 node_id: str = "", endpoint_id: str | None = None, **backend_kwargs):
        self.endpoint_id = endpoint_id or uuid.uuid4().hex[:12]
        self.kv_cache = kv_cache
        self.layout = layout
        self.node_id = node_id
        self.configured = backend
        self.backends: dict[str, TransportBackend] = create_backends(
            backend, self.endpoint_id, kv_cache, layout, **backend_kwargs)
        self._lock = threading.RLock()
        self._sending: dict[str, Transfer] = {}
        self._receiving: dict[str, Transfer] = {}
        # Landings reported before their transfer was expected: transfer id -> heads landed
        # (bounded: a notification that comes after its transfer was landed by the control
        # plane's word, or after it failed, is never claimed).
        self._landed_early: OrderedDict[str, set[int]] = OrderedDict()
        self._info: EndpointInfo | None = None
        for b in self.backends.values():
            b.landing_guard = self._landing
        if kv_cache.is_cuda:  # compile the block-copy kernel now, not during the first push
            zero = torch.zeros(1, dtype=torch.int64, device=kv_cache.device)
            copy_blocks(kv_cache, kv_cache, zero, zero)  # the null block onto itself

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def backend(self) -> TransportBackend:
        """The first backend served (the only one unless ``auto``)."""
        return next(iter(self.backends.values()))

    @property
    def receiver_writes(self) -> bool:
        """Every backend served copies incoming data itself (see ``TransportBackend``)."""
        return all(b.receiver_writes for b in self.backends.values())

    def native_notify(self, backend: str) -> bool:
        """Whether a transfer over ``backend`` is reported landed by the transport itself."""
        return self.backends[backend].native_notify

    def info(self) -> EndpointInfo:
        """What a peer needs to push here (computed once: every backend's connection data is
        fixed once the cache is registered)."""
        if self._info is None:
            connections = tuple((name, b.connection_info()) for name, b in self.backends.items())
            self._info = EndpointInfo(
                endpoint_id=self.endpoint_id, backend=connections[0][0], layout=self.layout,
                layout_hash=self.layout.compat_hash(), protocol_version=PROTOCOL_VERSION,
                num_blocks=self.num_blocks, connection=connections[0][1], node_id=self.node_id,
                device=str(self.kv_cache.device), connections=connections)
        return self._info

    def choose(self, peer: EndpointInfo) -> str:
        """The backend a push to ``peer`` uses; raises ``TransportUnavailableError``."""
        return choose_backend(self.configured, self.info(), peer)

    @property
    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(t.blocks) for t in (*self._sending.values(), *self._receiving.values()))

    # -- sender -----------------------------------------------------------------------------
    def push(self, peer: EndpointInfo, dest: KVDestination, src_block_ids: Sequence[int],
             on_finish: Callable[[Transfer], None] | None = None,
             heads: HeadSlice | None = None) -> Transfer:
        """Write the blocks ``dest`` lacks from ``src_block_ids`` (the request's blocks from its
        first one) into ``dest.block_ids``; with ``heads``, only those KV heads (a part of a
        tensor-parallel rank's, :class:`kvtransfer.replica.ReplicaEndpoint`). The source blocks
        are leased until the transfer is terminal. Raises :class:`LayoutMismatchError` before
        moving any byte if the layouts differ."""
        check_compatible(self.layout, peer.layout, PROTOCOL_VERSION, peer.protocol_version)
        if heads is None and (self.layout.heads != peer.layout.heads or peer.ranks):
            raise LayoutMismatchError(
                f"KV heads differ: this rank holds heads {self.layout.heads}, the peer "
                f"{peer.layout.heads} of {peer.layout.tp_size} rank(s); push through a "
                "ReplicaEndpoint (kvtransfer.endpoint_for), which maps heads between ranks")
        name = self.choose(peer)
        backend, peer = self.backends[name], peer.via(name)
        skip = dest.num_present_tokens // self.layout.block_size
        src = tuple(src_block_ids[skip:skip + len(dest.block_ids)])
        if len(src) != len(dest.block_ids):
            raise TransferError(f"request {dest.request_id}: {len(dest.block_ids)} destination "
                                f"blocks but {len(src)} source blocks after skipping {skip}")
        tid, per_block = dest.transfer_id, self.layout.block_bytes
        if heads is not None:
            first = peer.layout.heads[0] + heads.dst  # the model's heads it writes
            tid = part_id(tid, (first, first + heads.count))
            per_block = per_block * heads.count // self.layout.local_kv_heads
        stats = TransferStats(bytes=len(src) * per_block, blocks_sent=len(src),
                              blocks_skipped=skip, backend=name, src_node=self.node_id,
                              dst_node=peer.node_id)
        t = Transfer(tid, "send", name, src, dest.deadline, stats, on_finish, peer.endpoint_id)
        with self._lock:
            self._sending[t.transfer_id] = t
        if dest.expired():
            self._finish(t, TransferState.FAILED, "deadline passed before the push started")
            return t
        try:
            backend.connect(peer)
            stats.descriptors = _descriptor_count(self.layout, src, dest.block_ids, heads)
            t.handle = backend.start_write(peer, t.transfer_id, src, dest.block_ids, heads)
        except Exception as exc:  # noqa: BLE001 - any transport error fails the transfer
            log.warning("push %s failed to start: %s", t.transfer_id, exc)
            self._finish(t, TransferState.FAILED, f"{type(exc).__name__}: {exc}", peer_gone=True)
            return t
        t.update(TransferState.IN_FLIGHT)
        self._poll_send(t)
        return t

    def warm(self, peer: EndpointInfo, on_finish: Callable[[Transfer], None] | None = None,
             timeout_s: float = WARM_TIMEOUT_S, heads: HeadSlice | None = None) -> Transfer:
        """Open the link to ``peer`` before a request needs it: connect over the backend a push
        would use and write this cache's null block into the peer's, so the transport's own
        set-up (a NIXL remote agent and UCX wire-up, mapping a CUDA IPC handle, an NCCL
        communicator) is paid now. Driven like a push (``poll``); the peer ignores it."""
        dest = KVDestination(f"{WARM_PREFIX}{uuid.uuid4().hex[:8]}", peer.endpoint_id, (0,), 0,
                             time.time() + timeout_s)
        return self.push(peer, dest, (0,), on_finish, heads)

    # -- receiver ---------------------------------------------------------------------------
    def expect(self, dest: KVDestination,
               on_finish: Callable[[Transfer], None] | None = None) -> Transfer:
        """Lease ``dest.block_ids`` until their data lands, the deadline passes or an abort."""
        stats = TransferStats(blocks_sent=len(dest.block_ids),
                              blocks_skipped=dest.num_present_tokens // self.layout.block_size,
                              bytes=len(dest.block_ids) * self.layout.block_bytes)
        t = Transfer(dest.transfer_id, "recv", "", tuple(dest.block_ids), dest.deadline, stats,
                     on_finish, missing=set(range(*self.layout.heads)))
        with self._lock:
            self._receiving[t.transfer_id] = t
            t.missing -= self._landed_early.pop(t.transfer_id, set())
            landed = not t.missing
        t.update(TransferState.IN_FLIGHT)
        if landed:
            self._finish(t, TransferState.DONE)
        return t

    def mark_landed(self, transfer_id: str) -> None:
        """The control plane's word that a transfer has landed (backends without notifications):
        every head of it."""
        self._on_landed(transfer_id)

    def abort(self, transfer_id: str, reason: str = "aborted") -> None:
        with self._lock:
            t = self._sending.get(transfer_id) or self._receiving.get(transfer_id)
        if t is not None:
            self._finish(t, TransferState.FAILED, reason)

    # -- progress ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Transfers are in flight (sending or expected)."""
        return bool(self._sending or self._receiving)

    def poll(self, settle: bool = False) -> bool:
        """Move every transfer forward; True while some are still in flight. With none in
        flight the transport is not asked (a receiver expects before it is written to).
        ``settle``: first wait for the writes in flight that end on this node within
        milliseconds (``TransportBackend.settle_write``), so that they end in this call."""
        if not self.busy:
            return False
        if settle:
            with self._lock:
                handles = [(t.backend, t.handle) for t in self._sending.values()
                           if t.handle is not None]
            for backend, handle in handles:
                try:
                    self.backends[backend].settle_write(handle)
                except Exception:  # noqa: BLE001 - check_write reports the failure
                    log.debug("settling a write failed", exc_info=True)
        for b in self.backends.values():
            for tid in b.poll_notifications():
                self._on_landed(tid)
        now = time.time()
        with self._lock:
            sending, receiving = list(self._sending.values()), list(self._receiving.values())
        for t in sending:
            self._poll_send(t, now)
        for t in receiving:
            if now >= t.deadline + RECV_GRACE_S:
                self._finish(t, TransferState.FAILED, "deadline passed before the data landed")
        return self.busy

    def wait(self, t: Transfer, timeout: float | None = None) -> TransferState:
        """Poll until ``t`` is terminal (at the latest just after its deadline, or for a write
        still in flight then, ``DRAIN_MAX_S`` after it) or ``timeout`` seconds elapse."""
        start = time.time()
        end = None if timeout is None else start + timeout
        while True:
            self.poll()
            now = time.time()
            if t.state.is_terminal or (end is not None and now >= end):
                return t.state
            # Spin through the first milliseconds (hand-overs are that short), then back off.
            time.sleep(0 if now - start < SPIN_S else POLL_INTERVAL_S)

    def _poll_send(self, t: Transfer, now: float | None = None) -> None:
        if t.state.is_terminal:
            return
        try:
            state = self.backends[t.backend].check_write(t.handle)
        except Exception as exc:  # noqa: BLE001
            state, t.error = TransferState.FAILED, f"{type(exc).__name__}: {exc}"
        transport_failed = state is TransferState.FAILED  # not a deadline: that follows
        now = now or time.time()
        if state is TransferState.IN_FLIGHT and now >= t.deadline:
            if now < t.deadline + DRAIN_MAX_S:
                return  # it may still write: kept (and its source blocks) until it ends
            log.error("push %s: the write did not end within %.0f s of its deadline; its "
                      "source blocks are released anyway", t.transfer_id, DRAIN_MAX_S)
            state, t.error = TransferState.FAILED, "deadline passed before the write completed"
        if state.is_terminal:
            self._finish(t, state, t.error, peer_gone=transport_failed)

    @contextmanager
    def _landing(self, transfer_id: str):
        """For transports whose receiver writes the data itself: yields whether the transfer
        is still expected, holding the lock so it cannot fail (and release) meanwhile."""
        with self._lock:
            t = self._receiving.get(split_part(transfer_id)[0])
            yield t is not None and not t.state.is_terminal

    def _on_landed(self, transfer_id: str) -> None:
        if is_warm(transfer_id):
            return
        transfer_id, part = split_part(transfer_id)
        heads = set(range(*(part or self.layout.heads)))
        with self._lock:
            t = self._receiving.get(transfer_id)
            if t is None:
                self._landed_early.setdefault(transfer_id, set()).update(heads)
                if len(self._landed_early) > LANDED_EARLY_MAX:
                    self._landed_early.popitem(last=False)
                return
            t.missing -= heads
            if t.missing:
                return
        self._finish(t, TransferState.DONE)

    def _finish(self, t: Transfer, state: TransferState, error: str | None = None,
                peer_gone: bool = False) -> None:
        """``peer_gone``: a write failed in the transport (not by deadline, abort or close)."""
        with self._lock:
            table = self._sending if t.role == "send" else self._receiving
            if table.get(t.transfer_id) is t:
                del table[t.transfer_id]
        if t.role == "send" and t.handle is not None:
            try:
                self.backends[t.backend].release_write(t.handle)
            except Exception:  # noqa: BLE001 - best effort
                log.debug("release of %s failed", t.transfer_id, exc_info=True)
        if state is TransferState.FAILED and t.peer_id:
            log.warning("transfer %s to %s failed: %s", t.transfer_id, t.peer_id, error)
            if peer_gone:
                self._forget_peer(t.peer_id)
        t.update(state, error)

    def _forget_peer(self, peer_id: str) -> None:
        """A write to ``peer_id`` failed in the transport: the peer is likely gone (a restarted
        replica is a new endpoint). Drop what the backend keeps of it (a remote agent, a mapped
        cache) unless another write to it is still in flight; a live peer is connected again
        by its next push."""
        with self._lock:
            if any(s.peer_id == peer_id for s in self._sending.values()):
                return
        for b in self.backends.values():
            try:
                b.disconnect(peer_id)
            except Exception:  # noqa: BLE001 - best effort
                log.debug("disconnecting %s failed", peer_id, exc_info=True)

    def close(self) -> None:
        with self._lock:
            pending = [*self._sending.values(), *self._receiving.values()]
        for t in pending:
            self._finish(t, TransferState.FAILED, "endpoint closed")
        for b in self.backends.values():
            b.close()


def _descriptor_count(layout: KVLayout, src, dst, heads: HeadSlice | None) -> int:
    from kvtransfer.backends.base import block_runs
    return len(layout.regions(block_runs(src, dst), 0, heads))
