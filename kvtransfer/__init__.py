"""Moving KV blocks between engines: push only what the receiver lacks.

``KVEndpoint`` registers an engine's cache with a transport (``local``, ``nixl``, ``nccl``,
``cuda_ipc``); ``KVLayout``, ``KVDestination``, ``EndpointInfo`` and ``TransferStats`` are the
typed contracts between prefill and decode.
"""

import os
import socket
import sys

from kvtransfer.backends import BACKENDS, choose_backend, default_backend
from kvtransfer.endpoint import KVEndpoint, Transfer
from kvtransfer.types import (PROTOCOL_VERSION, EndpointInfo, KVDestination, KVLayout,
                              LayoutMismatchError, PushNotStarted, TransferError, TransferState,
                              TransferStats, TransportUnavailableError)

__all__ = [
    "BACKENDS", "PROTOCOL_VERSION", "EndpointInfo", "KVDestination", "KVEndpoint", "KVLayout",
    "LayoutMismatchError", "PushNotStarted", "Transfer", "TransferError", "TransferState", "TransferStats",
    "TransportUnavailableError", "choose_backend", "current_node_id", "default_backend",
    "layout_of", "endpoint_for",
]


def layout_of(engine) -> KVLayout:
    """The KV layout of an :class:`engine.LLMEngine`."""
    cfg = engine.source.config
    return KVLayout(model=engine.source.model_id, dtype=str(engine.dtype).removeprefix("torch."),
                    num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim, block_size=engine.config.block_size)


def endpoint_for(engine, backend: str = "local", polled: bool = False, **kwargs) -> KVEndpoint:
    """Register an engine's KV cache as a transfer endpoint. ``polled``: the owner polls the
    endpoint whenever a transfer is in flight (an engine thread does); NIXL on CPU then runs
    without its progress thread, which would spin a core that a small machine needs."""
    if polled and backend in ("nixl", "auto") and not engine.runner.kv_cache.is_cuda:
        kwargs.setdefault("progress_thread", False)
    kwargs.setdefault("node_id", current_node_id())
    return KVEndpoint(engine.runner.kv_cache, layout_of(engine), backend, **kwargs)


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
