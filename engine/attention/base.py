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
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``q``: ``[num_tokens, num_heads, head_dim]`` → ``[num_tokens, num_heads, head_dim]``
        (written into ``out`` when given). An FP8 ``kv_cache`` holds K / ``k_scale`` and V /
        ``v_scale``."""


# GQA group sizes FlashInfer's CUDA-core decode kernel is built for (``DISPATCH_GQA_GROUP_SIZE``
# in its utils.cuh); any other ratio (Qwen3-14B: 40 query heads over 8 KV heads = 5) has to run
# on tensor cores.
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)


def default_decode_tensor_cores(num_heads: int, num_kv_heads: int, fp8_kv: bool = False) -> bool:
    """Tensor-core decode where it pays: once four or more query heads share a KV head (Qwen3-4B
    and 8B: 32:8, faster or within 1% at 1-256 rows and 1k-4k tokens, and 8B's 256 sequences
    13.9 s of decode steps against 15.4 s on CUDA cores; two query heads a KV head are even),
    and over an FP8 cache (8B, 256 sequences: 12.4 s against 16.2 s); and wherever the
    CUDA-core kernel has no build (docs/benchmarks.md)."""
    group = num_heads // num_kv_heads
    return fp8_kv or group >= 4 or group not in CUDA_CORE_DECODE_GROUPS
