"""Triton, when installed (CUDA hosts); CPU-only installs run the torch references."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 256))
