"""The attention-backend interface: plan once per step, then run per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.forward_context import AttentionMetadata


class AttentionBackend(ABC):
    """Computes attention of a step's queries against the paged KV cache.

    ``plan`` is called once per step with the step's metadata (before the forward pass) and may
    stash precomputed state in ``meta.extras``; ``forward`` is called by every layer after the
    layer's new K/V have been stored.
    """

    name: str

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads, num_kv_heads, head_dim, scale)

    def plan(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Prepare per-step state shared by all layers (no-op by default)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q``: ``[num_tokens, num_heads, head_dim]`` → ``[num_tokens, num_heads, head_dim]``."""


def get_backend(name: str, device: torch.device, **dims) -> AttentionBackend:
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and _has_flashinfer() else "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(**dims)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend: 'flashinfer' needs a CUDA device")
        try:
            from engine.attention.flashinfer_backend import FlashInferBackend
        except ImportError as exc:
            raise ValueError(f"attention_backend: 'flashinfer' is not available ({exc})") from exc
        return FlashInferBackend(**dims)
    raise ValueError(f"attention_backend: unknown backend {name!r}")


def _has_flashinfer() -> bool:
    try:
        import engine.attention.flashinfer_backend  # noqa: F401
    except ImportError:
        return False
    return True
