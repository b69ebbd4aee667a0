"""Transports: ``local`` (in-process), ``nixl`` (UCX), ``nccl`` (torch.distributed; gloo on CPU),
``cuda_ipc`` (engines on one node)."""

from __future__ import annotations

from kvtransfer.backends.base import TransportBackend

BACKENDS = ("local", "nixl", "nccl", "cuda_ipc")


def create_backend(name: str, endpoint_id: str, kv_cache, layout, **kwargs) -> TransportBackend:
    if name == "local":
        from kvtransfer.backends.local import LocalBackend as cls
    elif name == "nixl":
        from kvtransfer.backends.nixl import NixlBackend as cls
    elif name == "nccl":
        from kvtransfer.backends.nccl import NcclBackend as cls
    elif name == "cuda_ipc":
        from kvtransfer.backends.cuda_ipc import CudaIpcBackend as cls
    else:
        raise ValueError(f"transfer backend: unknown backend {name!r}; choose from {BACKENDS}")
    return cls(endpoint_id, kv_cache, layout, **kwargs)


def default_backend(same_node: bool, device_type: str) -> str:
    """Same node on GPUs: CUDA IPC; otherwise NIXL (host memory over UCX on CPU)."""
    if device_type == "cuda" and same_node:
        return "cuda_ipc"
    return "nixl"
