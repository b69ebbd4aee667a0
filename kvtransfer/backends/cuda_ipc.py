"""CUDA IPC transport for engines on one node (processes that see the peer's GPU under the same
index, e.g. two replicas sharing one GPU): the receiver's KV tensor is opened once through
its IPC handle, and pushes are one block-copy kernel on a dedicated stream (each byte read and written once).

The receiver has no notification from the transport: the sender completes a push once its copy
event has fired, and the control plane (the prefill call returning) tells the receiver.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor

from kernels import copy_blocks
from kvtransfer.backends.base import TransportBackend, block_ids_tensor
from kvtransfer.types import EndpointInfo, TransferError, TransferState


class CudaIpcBackend(TransportBackend):
    name = "cuda_ipc"
    native_notify = False

    def __init__(self, endpoint_id, kv_cache, layout):
        if not kv_cache.is_cuda:
            raise TransferError("cuda_ipc needs the KV cache on a CUDA device")
        super().__init__(endpoint_id, kv_cache, layout)
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        self._peers: dict[str, torch.Tensor] = {}

    def connection_info(self) -> bytes:
        rebuild, args = reduce_tensor(self.kv_cache)
        return pickle.dumps((rebuild, args))

    def connect(self, peer: EndpointInfo) -> None:
        if peer.endpoint_id not in self._peers:
            rebuild, args = pickle.loads(peer.connection)  # noqa: S301 - our own peers' handles
            self._peers[peer.endpoint_id] = rebuild(*args)

    def start_write(self, peer: EndpointInfo, transfer_id: str, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int]) -> torch.cuda.Event:
        target = self._peers[peer.endpoint_id]
        event = torch.cuda.Event()
        self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self.stream):
            dev = self.kv_cache.device
            copy_blocks(self.kv_cache, target, block_ids_tensor(src_blocks, dev),
                        block_ids_tensor(dst_blocks, dev))
            event.record(self.stream)
        return event

    def check_write(self, handle: torch.cuda.Event) -> TransferState:
        return TransferState.DONE if handle.query() else TransferState.IN_FLIGHT

    def disconnect(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)
