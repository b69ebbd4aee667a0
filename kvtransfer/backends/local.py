"""In-process transport: endpoints that share a :class:`LocalFabric` copy straight into each
other's caches: for tests and in-process tools (``auto`` never picks it)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kernels import copy_blocks
from kvtransfer.backends.base import TransportBackend, block_ids_tensor as _ids, head_view
from kvtransfer.types import EndpointInfo, TransferError, TransferState


class LocalFabric:
    """A registry of the endpoints of one process that can reach each other."""

    def __init__(self):
        self._lock = threading.Lock()
        self._members: dict[str, "LocalBackend"] = {}

    def join(self, backend: "LocalBackend") -> None:
        with self._lock:
            self._members[backend.endpoint_id] = backend

    def leave(self, endpoint_id: str) -> None:
        with self._lock:
            self._members.pop(endpoint_id, None)

    def get(self, endpoint_id: str) -> "LocalBackend":
        with self._lock:
            member = self._members.get(endpoint_id)
        if member is None:
            raise TransferError(f"local peer {endpoint_id} is not in this process's fabric")
        return member


class LocalBackend(TransportBackend):
    name = "local"

    def __init__(self, endpoint_id, kv_cache, layout, fabric: LocalFabric | None = None):
        super().__init__(endpoint_id, kv_cache, layout)
        self.fabric = fabric or LocalFabric()
        self.fabric.join(self)
        self._landed: list[str] = []
        self._lock = threading.Lock()

    def start_write(self, peer: EndpointInfo, transfer_id: str, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int], heads=None) -> TransferState:
        target = self.fabric.get(peer.endpoint_id)
        if src_blocks:
            dev = self.kv_cache.device
            copy_blocks(head_view(self.kv_cache, heads, 0), head_view(target.kv_cache, heads, 1),
                        _ids(src_blocks, dev), _ids(dst_blocks, dev))
        target._land(transfer_id)
        return TransferState.DONE

    def check_write(self, handle: TransferState) -> TransferState:
        return handle

    def _land(self, transfer_id: str) -> None:
        with self._lock:
            self._landed.append(transfer_id)

    def poll_notifications(self) -> list[str]:
        with self._lock:
            landed, self._landed = self._landed, []
        return landed

    def close(self) -> None:
        self.fabric.leave(self.endpoint_id)
