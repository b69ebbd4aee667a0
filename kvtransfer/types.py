"""Typed, versioned contracts of the KV-transfer layer.

Nothing untyped goes on the wire: a peer learns about an endpoint from :class:`EndpointInfo`, a
prefill replica learns where to write from :class:`KVDestination`, and every hand-over reports
:class:`TransferStats`. (The prefill replica's reply, ``PrefillResult``, is a serving message:
:mod:`contracts.messages`.)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, fields, replace

from engine.kv_layout import RANK_FIELDS, KVLayout  # the engine's layout, checked here

PROTOCOL_VERSION = 1


class TransferState(enum.IntEnum):
    """Only moves forward; FAILED is absorbing and wins over everything."""

    PENDING = 0
    IN_FLIGHT = 1
    DONE = 2
    FAILED = 3

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


def advance(current: TransferState, new: TransferState) -> TransferState:
    if current is TransferState.FAILED or new is TransferState.FAILED:
        return TransferState.FAILED
    return max(current, new)


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete."""


class TransportUnavailableError(TransferError):
    """No transport can link this sender and receiver (for example ``cuda_ipc`` across nodes);
    raised before any byte moves."""


class PushNotStarted(TransferError):
    """A push failed before writing anything (its deadline had passed when the prefill replica
    got to it, or the transport would not start it): the receiver's blocks are untouched."""


class LayoutMismatchError(TransferError):
    """The two endpoints' KV layouts (or protocol versions) differ; no bytes were moved."""




@dataclass(frozen=True)
class HeadSlice:
    """The KV heads one rank writes into another: from local head ``src`` of the sender's cache
    to local head ``dst`` of the receiver's, ``count`` heads (of every layer, K and V)."""

    src: int
    dst: int
    count: int


def head_slice(sender: KVLayout, receiver: KVLayout) -> HeadSlice | None:
    """The heads ``sender``'s rank writes into ``receiver``'s, None when they share none."""
    (a, b), (c, d) = sender.heads, receiver.heads
    lo, hi = max(a, c), min(b, d)
    return HeadSlice(lo - a, lo - c, hi - lo) if lo < hi else None


def check_compatible(local: KVLayout, peer: KVLayout, local_version: int = PROTOCOL_VERSION,
                     peer_version: int = PROTOCOL_VERSION) -> None:
    """Raise :class:`LayoutMismatchError` naming the first field that differs, or the tensor
    parallel sizes when the heads cannot be split between them."""
    if local_version != peer_version:
        raise LayoutMismatchError(f"protocol_version: local {local_version} != peer {peer_version}")
    if local.compat_hash() != peer.compat_hash():
        diffs = [f"{f.name}: local {getattr(local, f.name)!r} != peer {getattr(peer, f.name)!r}"
                 for f in fields(KVLayout)
                 if f.name not in RANK_FIELDS and getattr(local, f.name) != getattr(peer, f.name)]
        raise LayoutMismatchError("KV layouts differ: " + "; ".join(diffs))
    for side, layout in (("local", local), ("peer", peer)):
        if layout.tp_size < 1 or local.num_kv_heads % layout.tp_size \
                or not 0 <= layout.tp_rank < layout.tp_size:
            raise LayoutMismatchError(
                f"KV heads cannot be mapped: {local.num_kv_heads} KV heads, {side} "
                f"tensor_parallel_size {layout.tp_size} (rank {layout.tp_rank}); local "
                f"{local.tp_size}, peer {peer.tp_size}")


@dataclass(frozen=True)
class EndpointInfo:
    """What a peer needs to push into an endpoint: identity, layout, backend connection data."""

    endpoint_id: str
    backend: str
    layout: KVLayout
    layout_hash: str
    protocol_version: int
    num_blocks: int
    connection: bytes = b""  # backend-specific (agent metadata, store address, IPC handle)
    node_id: str = ""
    device: str = "cpu"
    # Every backend the endpoint serves, with its connection data (``backend`` is the first).
    connections: tuple[tuple[str, bytes], ...] = ()
    # A replica of several tensor-parallel ranks: every rank's endpoint, rank 0's first (this
    # one is rank 0's, and names the replica).
    ranks: tuple[EndpointInfo, ...] = ()

    @property
    def rank_infos(self) -> tuple[EndpointInfo, ...]:
        return self.ranks or (self,)

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.connections) or (self.backend,)

    def via(self, backend: str) -> EndpointInfo:
        """This endpoint as seen through one of its backends (what that backend reads)."""
        if backend == self.backend and not self.connections:
            return self
        connection = dict(self.connections)[backend]
        return replace(self, backend=backend, connection=connection)


# Link warming (``KVEndpoint.warm``) writes the sender's null block (block 0: pinned, never read
# for a request) into the receiver's under a request id with this prefix; receivers ignore it.
WARM_PREFIX = "warm:"


def is_warm(transfer_id: str) -> bool:
    return transfer_id.partition("/")[2].startswith(WARM_PREFIX)


# A push of part of a rank's heads (tensor parallelism, ranks of different sizes) is a transfer
# of its own, named by the receiving rank's transfer id and the model's heads it writes; the
# receiving rank's transfer lands once its every head has landed.
_PART = "|h"


def part_id(transfer_id: str, heads: tuple[int, int]) -> str:
    return f"{transfer_id}{_PART}{heads[0]}-{heads[1]}"


def split_part(transfer_id: str) -> tuple[str, tuple[int, int] | None]:
    """``(transfer id, the model's heads [start, stop) it wrote, or None for all)``."""
    base, sep, heads = transfer_id.partition(_PART)
    if not sep:
        return base, None
    start, _, stop = heads.partition("-")
    return base, (int(start), int(stop))


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill replica must write a request's KV.

    ``block_ids`` are the receiver's blocks to fill, in order, starting at the block that holds
    token ``num_present_tokens`` (the receiver already holds the KV of the tokens before it, so
    those blocks are not sent). ``deadline`` is a ``time.time()`` instant.
    """

    request_id: str
    endpoint_id: str
    block_ids: tuple[int, ...]
    num_present_tokens: int
    deadline: float

    @property
    def transfer_id(self) -> str:
        return f"{self.endpoint_id}/{self.request_id}"

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.deadline


@dataclass
class TransferStats:
    bytes: int = 0
    blocks_sent: int = 0
    blocks_skipped: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    backend: str = ""  # the transport chosen for the pair
    src_node: str = ""  # the sender's and the receiver's node ids
    dst_node: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
