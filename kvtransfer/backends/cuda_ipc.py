"""CUDA IPC transport for engines on one node (processes that see the peer's GPU under the same
index: two replicas sharing one GPU, or processes that see all GPUs of the node): the receiver's KV tensor is opened once through
its IPC handle, and pushes are one block-copy kernel on a dedicated stream (each byte read and written once); to
another GPU, a pack, one peer copy and an unpack on the peer's device.

A tensor-parallel replica's worker ranks hold their own caches; rank 0 sees them through CUDA IPC
and cannot share them on (PyTorch refuses to send a received CUDA tensor), so such a rank's
endpoint is given the worker's own handle (``ipc_handle``) to offer its peers.

The receiver has no notification from the transport: the sender completes a push once its copy
event has fired, and the control plane (the prefill call returning) tells the receiver.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor

from kernels import copy_blocks
from kvtransfer.backends.base import TransportBackend, block_ids_tensor, head_view
from kvtransfer.types import EndpointInfo, TransferError, TransferState


class CudaIpcBackend(TransportBackend):
    name = "cuda_ipc"
    native_notify = False

    def __init__(self, endpoint_id, kv_cache, layout, ipc_handle: bytes | None = None):
        if not kv_cache.is_cuda:
            raise TransferError("cuda_ipc needs the KV cache on a CUDA device")
        super().__init__(endpoint_id, kv_cache, layout)
        self._handle = ipc_handle
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        self._peer_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._peers: dict[str, torch.Tensor] = {}

    def connection_info(self) -> bytes:
        if self._handle is not None:
            return self._handle
        return pickle.dumps(reduce_tensor(self.kv_cache))

    def connect(self, peer: EndpointInfo) -> None:
        if peer.endpoint_id not in self._peers:
            rebuild, args = pickle.loads(peer.connection)  # noqa: S301 - our own peers' handles
            cache = rebuild(*args)
            if cache.dtype != self.kv_cache.dtype:  # a worker's FP8 cache, handed out as it is
                cache = cache.view(self.kv_cache.dtype)
            self._peers[peer.endpoint_id] = cache

    def start_write(self, peer: EndpointInfo, transfer_id: str, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int], heads=None):
        """Returns ``(event, buffers to keep alive until the event fires)``."""
        target = head_view(self._peers[peer.endpoint_id], heads, 1)
        cache = head_view(self.kv_cache, heads, 0)
        dev = self.kv_cache.device
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream):
            src_ids = block_ids_tensor(src_blocks, dev)
            if target.device == dev:
                copy_blocks(cache, target, src_ids, block_ids_tensor(dst_blocks, dev))
                return _record(self.stream), ()
            # Another GPU of this node: pack here, one peer copy, unpack there (a kernel cannot
            # take a pointer into another device's memory).
            n = len(src_blocks)
            packed = torch.empty((cache.shape[0], n, *cache.shape[2:]), dtype=cache.dtype,
                                 device=dev)
            copy_blocks(cache, packed, src_ids, torch.arange(n, device=dev))
        peer_stream = self._peer_streams.setdefault(target.device,
                                                    torch.cuda.Stream(device=target.device))
        peer_stream.wait_stream(self.stream)
        with torch.cuda.device(target.device), torch.cuda.stream(peer_stream):
            landed = packed.to(target.device, non_blocking=True)
            copy_blocks(landed, target, torch.arange(n, device=target.device),
                        block_ids_tensor(dst_blocks, target.device))
            return _record(peer_stream), (packed, landed)

    def check_write(self, handle) -> TransferState:
        return TransferState.DONE if handle[0].query() else TransferState.IN_FLIGHT

    def settle_write(self, handle) -> None:
        handle[0].synchronize()  # block copies between this node's GPUs

    def disconnect(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event
