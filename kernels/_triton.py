"""Triton, when installed and a GPU is there; CPU hosts run the torch references (and do not
import Triton at all: it comes with xgrammar's dependencies even on CPU installs)."""

from __future__ import annotations

import torch

triton = tl = None
if torch.cuda.is_available():
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = tl = None


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 256))
