"""Transports: ``local`` (in-process), ``nixl`` (UCX), ``nccl`` (torch.distributed; gloo on CPU),
``cuda_ipc`` (engines on one node), and the choice of one per sender/receiver pair."""

from __future__ import annotations

import inspect
import logging

from kvtransfer.backends.base import TransportBackend
from kvtransfer.types import EndpointInfo, TransportUnavailableError

BACKENDS = ("local", "nixl", "nccl", "cuda_ipc")
log = logging.getLogger(__name__)


def backend_class(name: str) -> type[TransportBackend]:
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
    return cls


def create_backends(configured: str, endpoint_id: str, kv_cache, layout,
                    **kwargs) -> dict[str, TransportBackend]:
    """The backends an endpoint serves: the configured one, or for ``auto`` every one that
    :func:`choose_backend` may pick on this device (CUDA IPC and NIXL on a GPU, NIXL on CPU).
    Each keyword goes to the backends whose constructor takes it."""
    names = backends_for(configured, kv_cache.device.type)
    classes = {name: backend_class(name) for name in names}
    accepted = {name: inspect.signature(cls.__init__).parameters for name, cls in classes.items()}
    unused = [k for k in kwargs if not any(k in params for params in accepted.values())]
    if unused:
        raise TypeError(f"transfer backend options {unused} are taken by none of {names}")
    made = {}
    for name, cls in classes.items():
        try:
            made[name] = cls(endpoint_id, kv_cache, layout,
                             **{k: v for k, v in kwargs.items() if k in accepted[name]})
        except ImportError as exc:  # auto: serve what this install can (NIXL not installed)
            if configured != "auto" or len(classes) == 1:
                raise
            log.warning("transfer backend %s unavailable (%s); serving %s without it", name,
                        exc, [n for n in names if n != name])
    if not made:
        raise RuntimeError(f"no transfer backend of {names} could be started")
    return made


def backends_for(configured: str, device_type: str) -> tuple[str, ...]:
    if configured == "auto":
        return ("cuda_ipc", "nixl") if device_type == "cuda" else ("nixl",)
    backend_class(configured)  # an unknown name fails here
    return (configured,)


def default_backend(same_node: bool, device_type: str) -> str:
    """Same node on GPUs: CUDA IPC; otherwise NIXL (host memory over UCX on CPU)."""
    if device_type == "cuda" and same_node:
        return "cuda_ipc"
    return "nixl"


def choose_backend(configured: str, local: EndpointInfo, peer: EndpointInfo) -> str:
    """The transport from ``local`` (the sender) to ``peer``: ``auto`` picks
    :func:`default_backend` for the pair's placement (NIXL when that one is not served by both);
    an explicit backend is used as configured. Raises :class:`TransportUnavailableError`, before
    any byte moves, when the pair cannot use it (``cuda_ipc`` across nodes; a backend the peer
    does not serve), naming both nodes."""
    same_node = local.node_id == peer.node_id
    where = (f"sender {local.endpoint_id} on node {local.node_id or '?'} ({local.device}), "
             f"receiver {peer.endpoint_id} on node {peer.node_id or '?'} ({peer.device})")
    if configured == "auto":
        gpus = local.device.startswith("cuda") and peer.device.startswith("cuda")
        candidates = [default_backend(same_node, "cuda" if gpus else "cpu"), "nixl"]
    elif configured == "cuda_ipc" and not same_node:
        raise TransportUnavailableError(
            f"transfer backend 'cuda_ipc' needs both engines on one node: {where}; "
            "use 'auto' (NIXL across nodes) or 'nixl'")
    else:
        candidates = [configured]
    for name in candidates:
        if name in local.backends and name in peer.backends:
            return name
    raise TransportUnavailableError(
        f"no common transport for {configured!r}: {where}; the sender serves "
        f"{list(local.backends)}, the receiver {list(peer.backends)}")
