"""Skinny matmul for decode: ``y = x @ w.T`` for a few rows ``x`` ``[M, K]`` (M <= 8) and a
weight ``w`` ``[N, K]``. Each program streams ``BLOCK_N`` whole rows of ``w`` (contiguous along
K) and keeps fp32 partial products in registers, reducing once at the end; no split-K, so no
second kernel. The torch reference is ``F.linear``.

Measured on an H100 (``benchmarks/gemv_bench.py``, docs/benchmarks.md): for one row it beats
cuBLAS on every Qwen3-0.6B and 8B projection (by 8-38%); for four rows cuBLAS wins. The engine
therefore uses it for one-row steps only, per projection, where :func:`tune_gemv` measures it
faster at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton, use_triton

MAX_ROWS = 8


class GemvConfig(NamedTuple):
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        if M_PAD == 1:  # one row: keep the products, reduce once at the end
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs + k0, mask=rmask[:, None], other=0.0)
                    x = tl.load(x_ptr + k0 + cols)
                else:
                    kmask = k0 + cols < K
                    w = tl.load(w_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
                    x = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            y = tl.sum(acc, axis=1)
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
        else:  # a few rows: each weight tile is read once and used for every row
            m = tl.arange(0, M_PAD)
            mmask = m < M
            x_ptrs = x_ptr + m[:, None] * stride_xm + cols[None, :]
            acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kmask = k0 + cols < K
                w = tl.load(w_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
                x = tl.load(x_ptrs + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
            tl.store(y_ptr + m[:, None] * stride_ym + rows[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


def gemv_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype)


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    if not gemv_supported(x, w):
        return gemv_reference(x, w)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return y


# The winners of benchmarks/gemv_bench.py's grid for one row on Qwen3 0.6B and 8B shapes.
CANDIDATES = (GemvConfig(4, 512, 4, 2), GemvConfig(4, 1024, 8, 2), GemvConfig(8, 512, 4, 4),
              GemvConfig(8, 1024, 8, 2), GemvConfig(4, 1024, 8, 4))


def tune_gemv(weights: Sequence[torch.Tensor],
              candidates: Sequence[GemvConfig] = CANDIDATES) -> GemvConfig | None:
    """The fastest way to multiply one row by each of ``weights`` (same shape, e.g. one
    projection of every layer), as a CUDA graph of one call per weight in order, so each weight
    streams from memory as in a forward pass: a candidate config, or None when cuBLAS wins."""
    x = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)
    if not gemv_supported(x, weights[0]):
        return None

    def time_us(fn) -> float:
        for w in weights[:2]:
            fn(x, w)  # compile, settle
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                fn(x, w)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    best, best_us = None, time_us(gemv_reference)
    for cfg in candidates:
        us = time_us(lambda a, b, c=cfg: gemv(a, b, c))
        if us < best_us:
            best, best_us = cfg, us
    return best
