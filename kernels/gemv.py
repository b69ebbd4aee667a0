"""Skinny matmul for decode: ``y = x @ w.T`` for a few rows ``x`` ``[M, K]`` (M <= 8) and a
weight ``w`` ``[N, K]``. Each program streams ``BLOCK_N`` whole rows of ``w`` (contiguous along
K) and keeps fp32 partial products in registers, reducing once at the end; no split-K, so no
second kernel. The torch reference is ``F.linear``.

Measured on an H100 (``projections_bench bf16``, docs/benchmarks.md): for one row it beats
cuBLAS on every Qwen3-0.6B and 8B projection (by 8-38%); for four rows cuBLAS wins. The engine
therefore uses it for one-row steps only, with the tile config :func:`config_for` gives the
weight's shape. :func:`norm_gemv` also folds the residual add and RMSNorm in front of a
projection into the same kernel (each program recomputes the row's RMS, then normalises the row
chunk by chunk as it streams the weight), used where that measured faster.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._triton import pdl, tl, triton, use_triton, wait_for_inputs
from kernels.activation import silu_and_mul
from kernels.norm import rmsnorm_reference

MAX_ROWS = 8


class GemvConfig(NamedTuple):
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


if triton is not None:
    from kernels.activation import silu_mul, silu_times

    @triton.jit
    def row_input(x_ptr, k0, cols, K, SILU: tl.constexpr, EVEN_K: tl.constexpr):
        """A one-row kernel's input at ``k0 + cols``, in float32: ``x`` itself, or with SILU
        the SiLU-and-multiply of the packed ``[gate | up]`` row (``2K`` wide) there, rounded as
        ``kernels.activation.silu_and_mul`` rounds it (so the product is the same)."""
        if SILU:
            x = silu_mul(x_ptr + k0, cols, k0 + cols < K, K, EVEN_K)
        elif EVEN_K:
            x = tl.load(x_ptr + k0 + cols)
        else:
            x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def weight_tile(w_ptrs, k0, rmask, cols, K, EVEN_K: tl.constexpr):
        """A one-row kernel's weight rows at K offset ``k0``. They are read once: evicted
        first, so they do not push the row vector out of the cache."""
        if EVEN_K:
            return tl.load(w_ptrs + k0, mask=rmask[:, None], other=0.0,
                           eviction_policy="evict_first")
        return tl.load(w_ptrs + k0, mask=rmask[:, None] & (k0 + cols < K)[None, :], other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def program_rows(N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
        """The weight rows a one-row kernel's program streams, and which are real. GLU: the
        weight is a packed ``[gate | up]`` projection of ``N`` rows, and the program streams
        gate rows ``j`` and up rows ``N / 2 + j`` of its ``BLOCK_N / 2`` outputs ``j``,
        interleaved (gate, up, gate, up, ...) for :func:`store_rows`."""
        if GLU:
            r = tl.arange(0, BLOCK_N)
            j = tl.program_id(0) * (BLOCK_N // 2) + r // 2
            return j + (r % 2) * (N // 2), j < N // 2
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, rows < N

    @triton.jit
    def store_rows(y_ptr, y, rows, rmask, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
        """A one-row kernel's products ``y`` (float32, one per row of :func:`program_rows`)
        into ``y_ptr``, rounded to its dtype. GLU: ``silu(gate) * up`` of each (gate, up) pair
        instead, rounded as the projection then ``kernels.activation.silu_and_mul`` round it
        (so the bytes are those of the two kernels)."""
        y = y.to(y_ptr.dtype.element_ty)
        if GLU:
            gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            j = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(y_ptr + j, silu_times(gate, up), mask=j < N // 2)
        else:
            tl.store(y_ptr + rows, y, mask=rmask)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, SILU: tl.constexpr, GLU: tl.constexpr,
                     PDL: tl.constexpr):
        rows, rmask = program_rows(N, BLOCK_N, GLU)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        if M_PAD == 1:  # one row: keep the products, reduce once at the end
            # The first weight tile is read before the wait (under PDL, while the kernel before
            # still runs); then the same sum as a loop from zero.
            w = weight_tile(w_ptrs, 0, rmask, cols, K, EVEN_K)
            wait_for_inputs(PDL)
            acc = w.to(tl.float32) * row_input(x_ptr, 0, cols, K, SILU, EVEN_K)[None, :]
            for k0 in range(BLOCK_K, K, BLOCK_K):
                w = weight_tile(w_ptrs, k0, rmask, cols, K, EVEN_K)
                x = row_input(x_ptr, k0, cols, K, SILU, EVEN_K)
                acc += w.to(tl.float32) * x[None, :]
            store_rows(y_ptr, tl.sum(acc, axis=1), rows, rmask, N, BLOCK_N, GLU)
        else:  # a few rows: each weight tile read once, used by all
            wait_for_inputs(PDL)
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


if triton is not None:
    @triton.jit
    def _normed_chunk(x_ptr, res_ptr, nw_ptr, k0, cols, K, rstd, HAS_RES: tl.constexpr):
        """The normed row (after the residual add) at ``k0 + cols``, in float32, rounded as
        ``kernels.norm.rmsnorm_reference`` rounds it."""
        kmask = k0 + cols < K
        h = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0)
        dtype = h.dtype
        if HAS_RES:
            h = (h.to(tl.float32) + tl.load(res_ptr + k0 + cols, mask=kmask,
                                            other=0.0).to(tl.float32)).to(dtype)
        nw = tl.load(nw_ptr + k0 + cols, mask=kmask, other=0.0).to(tl.float32)
        return ((h.to(tl.float32) * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)

    @triton.jit
    def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, res_out_ptr, N, K, eps,
                          stride_wn, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_K)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        # The first weight tile before the wait (under PDL, while the kernel before still runs).
        w = tl.load(w_ptrs, mask=rmask[:, None] & (cols < K)[None, :], other=0.0)
        wait_for_inputs(PDL)
        # Pass 1, the row's RMS (program 0 also writes the new residual).
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = k0 + cols < K
            h = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0)
            if HAS_RES:
                h = (h.to(tl.float32) + tl.load(res_ptr + k0 + cols, mask=kmask,
                                                other=0.0).to(tl.float32)).to(h.dtype)
                if pid == 0:
                    tl.store(res_out_ptr + k0 + cols, h, mask=kmask)
            hf = h.to(tl.float32)
            sq += hf * hf
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        # Pass 2, the product with the normed row, rebuilt chunk by chunk.
        acc = w.to(tl.float32) * _normed_chunk(x_ptr, res_ptr, nw_ptr, 0, cols, K, rstd,
                                               HAS_RES)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kmask = k0 + cols < K
            w = tl.load(w_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
            xn = _normed_chunk(x_ptr, res_ptr, nw_ptr, k0, cols, K, rstd, HAS_RES)
            acc += w.to(tl.float32) * xn[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def norm_gemv_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, w: torch.Tensor):
    """``F.linear(rmsnorm(x [+ residual]), w)`` and the new residual (``x`` without one)."""
    if residual is None:
        return F.linear(rmsnorm_reference(x, norm_weight, eps), w), x
    normed, residual = rmsnorm_reference(x, norm_weight, eps, residual)
    return F.linear(normed, w), residual


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, w: torch.Tensor, config: GemvConfig = GemvConfig()):
    """One row: residual add, RMSNorm and the projection in one kernel (the normed row never
    goes to memory). Returns ``(y, new residual)`` as :func:`norm_gemv_reference`."""
    if not (gemv_supported(x, w) and x.shape[0] == 1 and norm_weight.dtype == x.dtype
            and (residual is None or residual.stride(1) == 1)):
        return norm_gemv_reference(x, residual, norm_weight, eps, w)
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    _norm_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm_weight, w, y, res_out, n, k, eps,
        w.stride(0), HAS_RES=residual is not None, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl(x))
    return y, res_out


def gemv_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype)


def glu_supported(x: torch.Tensor, w: torch.Tensor, block_n: int) -> bool:
    """Whether a one-row kernel can end a packed ``[gate | up]`` projection ``w`` with the
    SiLU-and-multiply (``glu``): one row, an even row count, and programs of whole pairs."""
    return x.shape[0] == 1 and w.shape[0] % 2 == 0 and block_n % 2 == 0


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = GemvConfig(),
         silu: bool = False, glu: bool = False) -> torch.Tensor:
    """``x @ w.T``; ``silu`` (one row): ``x`` is a packed ``[gate | up]`` row and the product is
    of its SiLU-and-multiply, computed in the kernel (no launch of its own); ``glu`` (one row):
    ``w`` is the packed ``[gate | up]`` projection and the result its SiLU-and-multiply
    (``[1, N / 2]``), computed in the kernel's epilogue."""
    if silu and not (gemv_supported(x, w) and x.shape[0] == 1 and x.shape[1] == 2 * w.shape[1]):
        return gemv(silu_and_mul(x), w, config)
    if glu and not (gemv_supported(x, w) and glu_supported(x, w, config.block_n)):
        return silu_and_mul(gemv(x, w, config))
    if not gemv_supported(x, w):
        return gemv_reference(x, w)
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    y = torch.empty((m, n // 2 if glu else n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, SILU=silu, GLU=glu,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl(x))
    return y


# Projections whose input RMSNorm (with the residual add) is folded into them for one row: where
# it measured faster (hidden size 1024, Qwen3-0.6B: -35 us a step); at 4096 (8B) it did not pay.
NORM_FUSE_MAX_K = 1024
# Down projections whose SiLU-and-multiply is folded into them for one row (each program
# recomputes the activation of the K range it streams): where it measured faster, K of 3072
# (Qwen3-0.6B: 1.160 -> 1.125 ms a step on an H100); at 12,288 (8B, FP8 weights: 4.02 -> 4.15 ms)
# the activation's reads cost more than the launch they save.
SILU_FUSE_MAX_K = 3072
# Wider down projections take their one-row input from the gate/up projection's epilogue instead
# (``gemv(..., glu=True)``: each program streams gate row j and up row I + j and writes the
# SiLU-and-multiply of the pair; one launch fewer a layer, no activation read twice).
# ``BATON_GLU_EPILOGUE=0`` runs the SiLU kernel there instead (the A/B of its figures).
GLU_EPILOGUE = os.environ.get("BATON_GLU_EPILOGUE", "1") != "0"


# The winners of ``projections_bench chain --grid`` on the H100 (a batch-1 step's projections and
# LM head chained in one CUDA graph under programmatic dependent launch, each projection's grid
# tried with the others at their best), per Qwen3 projection shape ``(n, k)``: the sizes whose
# rule configs were more than ~1% off (0.6B, 1.7B, 4B; 8B's rule was within 0.5%).
CHAIN_WINNERS = {
    (4096, 1024): (16, 1024, 4, 2), (1024, 2048): (4, 2048, 8, 2),  # 0.6B qkv, o
    (1024, 3072): (4, 4096, 8, 2),  # 0.6B down (its gate/up and head: the rule)
    (4096, 2048): (2, 2048, 4, 2), (2048, 2048): (4, 2048, 4, 2),  # 1.7B qkv, o
    (12288, 2048): (2, 1024, 4, 2), (151936, 2048): (2, 1024, 4, 2),  # 1.7B gate/up, head
    (6144, 2560): (16, 512, 8, 2), (2560, 4096): (4, 2048, 8, 2),  # 4B qkv, o
    (19456, 2560): (4, 512, 4, 2), (2560, 9728): (2, 2048, 8, 2),  # 4B gate/up, down
    (151936, 2560): (4, 512, 4, 2),  # 4B head
}


def config_for(n: int, k: int) -> GemvConfig:
    """The tile config for a ``[n, k]`` weight: :data:`CHAIN_WINNERS` for the shapes measured
    there, else rules that reproduce the winners of ``projections_bench bf16`` on the H100 for
    the Qwen3-0.6B projections (its 48-config grid) and the 8B ones (K of 4096 and more:
    ``--streaming``, K tiles of 2048). Fixed by shape, not timed at start-up, so every engine
    sums a projection in the same order (a prefill and a decode replica then give the tokens of
    one colocated engine)."""
    if (n, k) in CHAIN_WINNERS:
        return GemvConfig(*CHAIN_WINNERS[n, k])
    if k >= 4096:
        return GemvConfig(block_n=4, block_k=2048, num_warps=4, num_stages=2)
    small_k = k <= 1024
    return GemvConfig(block_n=8 if n >= 6144 else 4, block_k=512 if small_k else 1024,
                      num_warps=4 if small_k else 8,
                      num_stages=4 if small_k and n >= 6144 else 2)
