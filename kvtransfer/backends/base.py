"""The transport interface: the mechanics of moving blocks, driven by :class:`KVEndpoint`.

A backend writes source blocks of its own cache into a peer's cache (push; the receiver never
pulls) and, where the transport can, tells the receiver which transfers have landed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvtransfer.types import EndpointInfo, HeadSlice, KVLayout, TransferState


class TransportBackend(ABC):
    name: str
    #: True when the receiver learns of completion from the transport itself (a notification);
    #: otherwise the sender's completion reaches it through the control plane.
    native_notify: bool = True
    #: True when the receiver copies the data into its cache itself (under the endpoint's
    #: landing guard), so an aborted transfer can release its blocks at once. Otherwise the
    #: sender writes one-sided into the receiver's memory, and a receiver that gives up early
    #: must keep the blocks until the sender can no longer write.
    receiver_writes: bool = False

    def __init__(self, endpoint_id: str, kv_cache: torch.Tensor, layout: KVLayout):
        self.endpoint_id = endpoint_id
        self.kv_cache = kv_cache
        self.layout = layout
        self.landing_guard = _always_expected  # the endpoint installs its own


    def connection_info(self) -> bytes:
        """What a peer needs to reach this endpoint (goes into ``EndpointInfo.connection``)."""
        return b""

    def connect(self, peer: EndpointInfo) -> None:  # noqa: B027 - optional hook
        """Prepare to write into ``peer`` (idempotent; called before each push)."""

    @abstractmethod
    def start_write(self, peer: EndpointInfo, transfer_id: str, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int], heads: HeadSlice | None = None) -> Any:
        """Start writing ``src_blocks`` of the local cache into ``dst_blocks`` of the peer's
        (with ``heads``, only those heads: tensor-parallel ranks of different sizes); returns a
        handle for :meth:`check_write`."""

    @abstractmethod
    def check_write(self, handle: Any) -> TransferState:
        """IN_FLIGHT, DONE or FAILED."""

    def settle_write(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """Block until the write is over where that takes microseconds to a few milliseconds on
        this node (a copy between local GPUs), so that a sender polling once per engine step
        learns of it in this poll rather than the next. Transports whose writes cross a network
        or need the peer's part return at once."""

    def release_write(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """Free the handle's resources (called once the write is terminal or abandoned)."""

    def poll_notifications(self) -> list[str]:
        """Transfer ids whose data has fully landed in this endpoint's cache since last call."""
        return []

    def disconnect(self, peer_id: str) -> None:  # noqa: B027 - optional hook
        """Forget a peer (after it failed)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources."""


def head_view(cache: torch.Tensor, heads: HeadSlice | None, side: int) -> torch.Tensor:
    """The part of ``cache`` (``[layer, block, K/V, head, slot, dim]`` over block-major memory)
    that ``heads`` names on ``side`` (0: sender, 1: receiver), as ``[layer and K/V, block, head,
    slot, dim]``: each (layer and K/V, block) chunk is contiguous, so the block-copy kernel takes
    it as it takes a whole cache. Without ``heads``, the cache itself."""
    if heads is None:
        return cache
    layers, blocks, _, _, slots, dim = cache.shape
    st = cache.stride()
    assert st[0] == 2 * st[2], "the cache is not block-major"
    first = heads.src if side == 0 else heads.dst
    return cache.as_strided((2 * layers, blocks, heads.count, slots, dim),
                            (st[2], st[1], st[3], st[4], st[5]),
                            cache.storage_offset() + first * st[3])


def block_ids_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


@contextmanager
def _always_expected(transfer_id: str):
    yield True


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce paired block ids into ``(src_start, dst_start, count)`` runs, so that
    consecutive blocks on both sides move as one region (:meth:`KVLayout.regions`)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
