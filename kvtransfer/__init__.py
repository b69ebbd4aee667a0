"""Moving KV blocks between engines: push only what the receiver lacks.

``KVEndpoint`` registers an engine's cache with a transport (``local``, ``nixl``, ``nccl``,
``cuda_ipc``); ``KVLayout``, ``KVDestination``, ``EndpointInfo`` and ``TransferStats`` are the
typed contracts between prefill and decode.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from typing import TYPE_CHECKING

import torch

from kvtransfer.backends import BACKENDS, backends_for, choose_backend, default_backend
from kvtransfer.endpoint import KVEndpoint, Transfer
from kvtransfer.replica import ReplicaEndpoint
from kvtransfer.types import (PROTOCOL_VERSION, EndpointInfo, KVDestination, KVLayout,
                              LayoutMismatchError, PushNotStarted, TransferError, TransferState,
                              TransferStats, TransportUnavailableError)

if TYPE_CHECKING:  # the engine does not import this package, nor this package the engine
    from engine import KVCacheSpec

__all__ = [
    "BACKENDS", "PROTOCOL_VERSION", "EndpointInfo", "KVDestination", "KVEndpoint", "KVLayout",
    "LayoutMismatchError", "PushNotStarted", "ReplicaEndpoint", "Transfer", "TransferError",
    "TransferState", "TransferStats",
    "TransportUnavailableError", "choose_backend", "current_node_id", "default_backend",
    "endpoint_for",
]


def endpoint_for(spec: KVCacheSpec, backend: str = "local", polled: bool = False,
                 endpoint_id: str | None = None, **kwargs) -> ReplicaEndpoint:
    """Register an engine's KV cache (:meth:`engine.LLMEngine.kv_cache_spec`) as a transfer
    endpoint: one per tensor-parallel rank (ids ``<id>``, ``<id>.1``, ...), driven as one.
    ``polled``: the owner polls the endpoint whenever a transfer is in flight (an engine thread
    does); NIXL on CPU then runs without its progress thread, which would spin a core that a
    small machine needs. A worker rank's cache is offered to peers by its own CUDA IPC handle
    (``spec.handles``): rank 0 holds it through IPC and cannot share it on."""
    if polled and backend in ("nixl", "auto") and not spec.kv_cache.is_cuda:
        kwargs.setdefault("progress_thread", False)
    kwargs.setdefault("node_id", current_node_id())
    endpoint_id = endpoint_id or uuid.uuid4().hex[:12]
    ipc = "cuda_ipc" in backends_for(backend, spec.kv_cache.device.type)
    handles = spec.handles or (None,) * spec.tp_size
    ranks = []
    for rank, (cache, handle) in enumerate(zip(spec.caches, handles)):
        if cache.element_size() == 1:  # FP8 blocks move as bytes (every transport knows uint8)
            cache = cache.view(torch.uint8)
        own = {"ipc_handle": handle} if ipc and handle is not None else {}
        ranks.append(KVEndpoint(cache, spec.rank_layout(rank), backend,
                                endpoint_id=endpoint_id if rank == 0 else f"{endpoint_id}.{rank}",
                                **own, **kwargs))
    return ReplicaEndpoint(ranks)


def current_node_id() -> str:
    """The node this process runs on, as transports see it: ``BATON_NODE_ID`` if set, the Ray
    node id inside a Ray worker (a Serve replica; several raylets on one machine are several
    nodes), the host name otherwise."""
    if node := os.environ.get("BATON_NODE_ID"):
        return node
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ctx = ray.get_runtime_context()
        if ctx.worker.mode == ray.WORKER_MODE:
            return ctx.get_node_id()
    return socket.gethostname()
