"""The attention-backend interface: plan once per step, then run per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.forward_context import AttentionMetadata


class AttentionBackend(ABC):
    """Computes attention of a step's queries against the paged KV cache.

    ``plan`` is called once per step with the step's metadata (before the forward pass) and may
    stash precomputed state in ``meta.extras``; ``forward`` is called by every layer after the
    layer's new K/V have been stored. ``supports_cuda_graphs`` backends also hand out decode
    wrappers with fixed buffers (``graph_decode_wrapper``, re-planned by ``plan_decode``) that a
    captured graph replays.
    """

    name: str
    supports_cuda_graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads, num_kv_heads, head_dim, scale)
        self.block_size = block_size

    def plan(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Prepare per-step state shared by all layers (no-op by default)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q``: ``[num_tokens, num_heads, head_dim]`` → ``[num_tokens, num_heads, head_dim]``."""


def get_backend(name: str, device: torch.device, dtype: torch.dtype,
                decode_tensor_cores: bool | None = None, **dims) -> AttentionBackend:
    """``auto``: FlashInfer on CUDA in 16-bit dtypes for the head sizes it builds kernels for
    (64, 128, 256) when it is installed, else torch."""
    if name == "auto":
        name = ("flashinfer" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
                and dims.get("head_dim") in (64, 128, 256) and _has_flashinfer() else "torch")
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(**dims)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend: 'flashinfer' needs a CUDA device")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend: 'flashinfer' needs bfloat16 or float16, not "
                             f"{dtype}")
        try:
            from engine.attention.flashinfer_backend import FlashInferBackend
        except ImportError as exc:
            raise ValueError(f"attention_backend: 'flashinfer' is not available ({exc})") from exc
        return FlashInferBackend(**dims, device=device, dtype=dtype,
                                 decode_tensor_cores=decode_tensor_cores)
    raise ValueError(f"attention_backend: unknown backend {name!r}")


def _has_flashinfer() -> bool:
    try:
        import engine.attention.flashinfer_backend  # noqa: F401
    except ImportError:
        return False
    return True
