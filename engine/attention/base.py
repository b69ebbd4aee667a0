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
