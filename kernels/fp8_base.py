"""The e4m3 element type and per-row activation quantization's reference, which the norm and
SiLU kernels that quantize their output share with :mod:`kernels.fp8` (kept apart so that those
modules need not import the FP8 linear layers, which import them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3, saturating at ±448 (e4m3fn has no infinity)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_reference(x: torch.Tensor, group: int | None = None):
    """Dynamic activation scales: one per row (``group=None``) or per 1×``group`` slice of a
    row. Returns e4m3 ``[M, K]`` and float32 scales ``[M, 1]`` or ``[M, ceil(K/group)]``."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return to_fp8(xf / scale), scale
    groups = -(-k // group)
    padded = F.pad(xf, (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    q = to_fp8(padded / scale[:, :, None]).view(m, groups * group)[:, :k]
    return q.contiguous(), scale
