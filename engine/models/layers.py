"""Building blocks: RMSNorm (with fused residual add), rotary embedding, SiLU-and-multiply."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like transformers; ``forward(x, residual)`` adds first and
    returns ``(normed, new_residual)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate half) with a cos/sin cache built after the model is on its device.

    The cache is a plain attribute, not a buffer, so ``to_empty`` from the meta device cannot leave
    it uninitialised; call :meth:`build` once the module is on its device.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.cos_sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(device, torch.float)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        t = torch.arange(self.max_positions, device=device, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, head_dim] float32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``q``: ``[T, Hq, D]``, ``k``: ``[T, Hk, D]``; rotated in their own dtype."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
