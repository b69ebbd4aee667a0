"""FP8 (e4m3) linear layers: weights in FP8 with per-output-channel or per-block scales,
activations quantized on the fly (dynamic scales, one per token or per 1×128 group).

Two weight formats, as checkpoints ship them:
- *channel*: ``w`` ``[N, K]`` e4m3 and ``scale`` ``[N, 1]`` float32 (llm-compressor's
  ``compressed-tensors`` FP8, and Baton's on-the-fly quantization);
- *block*: ``w`` ``[N, K]`` e4m3 and ``scale`` ``[ceil(N/bn), ceil(K/bk)]`` float32, one scale per
  ``bn × bk`` tile (Qwen's own FP8 checkpoints: ``weight_scale_inv``, 128×128).

The real value of a weight is ``w * scale`` (of its row, or of its tile). Kernels:
- one row (batch-1 decode): :func:`fp8_gemv`, a Triton skinny matmul that reads the FP8 weight
  (half the bytes of bf16), applies the scales in the sum and keeps the activation in bf16;
- more rows, channel format: the activation is quantized per token (:func:`quantize_rows`) and
  multiplied by ``torch._scaled_mm`` with row-wise scales (cuBLASLt FP8 GEMM);
- more rows, block format: the activation is quantized per 1×``bk`` group and multiplied by
  :func:`_block_mm_kernel`, a Triton FP8 GEMM that applies both scales per K tile.

Each op has a torch reference in float32 (the CPU path and what the kernels are tested
against). Where FP8 matmuls are missing (CPU, GPUs before compute capability 8.9) the engine does
not call these: it dequantizes weights at load (:func:`dequantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import pdl, tl, triton, use_triton, wait_for_inputs
from kernels.activation import silu_and_mul
from kernels.fp8_base import FP8, FP8_MAX, quantize_rows_reference, to_fp8  # noqa: F401
from kernels.fp8_base import MIN_SCALE as _MIN_SCALE
from kernels.gemv import GemvConfig, glu_supported


def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls on this device: CUDA with compute capability 8.9 or newer (Ada, Hopper)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
            and triton is not None)


# -- quantization and its inverse (torch; also the references) --------------------------------
def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` → e4m3 weight and ``[N, 1]`` float32 scales (amax of each row / 448)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return to_fp8(wf / scale), scale


def quantize_per_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """``[N, K]`` → e4m3 weight and float32 scales ``[ceil(N/bn), ceil(K/bk)]``, one per tile
    (amax of the tile / 448): the format of Qwen's FP8 checkpoints."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    tiles = F.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n)).view(rows, bn, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = to_fp8(tiles / scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
    return q.contiguous(), scale


def expand_block_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]):
    """Per-tile scales ``[ceil(N/bn), ceil(K/bk)]`` → one per element ``[N, K]``."""
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize(w: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """The real values of an FP8 weight, in float32. ``scale``: ``[N, 1]``, a scalar (one for
    the tensor), or per tile with ``block``."""
    wf = w.float()
    if block is not None:
        return wf * expand_block_scale(scale.float(), w.shape, block)
    scale = scale.float()
    return wf * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def w8a8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """What the multi-row kernels compute: ``x`` quantized per token (channel format) or per
    1×bk group (block format), times the dequantized weight, in float32, rounded to x's dtype."""
    xq, xs = quantize_rows_reference(x, None if block is None else block[1])
    xd = xq.float() * (xs if block is None else xs.repeat_interleave(block[1], 1)[:, :x.shape[1]])
    return (xd @ dequantize(w, scale, block).t()).to(x.dtype)


def scaled_rows_reference(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor,
                          scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Channel format, activations quantized already (``xq`` e4m3 and ``xs`` ``[M, 1]``, as a
    norm or SiLU kernel that quantizes its output gives them): what :func:`fp8_scaled_rows`
    computes, in float32, rounded to ``dtype``."""
    return ((xq.float() * xs) @ dequantize(w, scale).t()).to(dtype)


def fp8_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """The one-row kernel: the activation stays in its dtype, the weight is dequantized."""
    return (x.float() @ dequantize(w, scale, block).t()).to(x.dtype)


# -- Triton kernels ---------------------------------------------------------------------------
if triton is not None:
    from kernels.gemv import program_rows, row_input, store_rows, weight_tile

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s,
                              GROUP: tl.constexpr, GROUPS_PER_ROW: tl.constexpr):
        """One program per (row, group); GROUPS_PER_ROW == 1 with GROUP >= K: per-row scale."""
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_s + g, scale)

    @triton.jit
    def _fp8_term(x_ptr, s_ptr, w, k0, cols, K, tile_row, stride_sn, BLOCK_SCALE: tl.constexpr,
                  GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, SILU: tl.constexpr):
        """One K tile's products ``w * x`` (float32), the tile scales folded into x (block
        format)."""
        x = row_input(x_ptr, k0, cols, K, SILU, EVEN_K)
        if BLOCK_SCALE:
            if EVEN_K:
                x *= tl.load(s_ptr + tile_row * stride_sn + (k0 + cols) // GROUP_K)
            else:
                x *= tl.load(s_ptr + tile_row * stride_sn + (k0 + cols) // GROUP_K,
                             mask=k0 + cols < K, other=0.0)
        return w.to(tl.float32) * x[None, :]

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                         BLOCK_SCALE: tl.constexpr, GROUP_N: tl.constexpr,
                         GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, SILU: tl.constexpr, GLU: tl.constexpr,
                         PDL: tl.constexpr):
        """``y = x @ (w * scale).T`` for one row: each program streams BLOCK_N whole rows of the
        FP8 weight. Block format: BLOCK_N divides GROUP_N, so a program's rows share one row
        of tiles, and the scale of each K position folds into x. The first weight tile is read
        before the wait for the kernel before (``kernels._triton.wait_for_inputs``). GLU (not
        with the block format): ``kernels.gemv.program_rows``' pairs of a packed gate/up."""
        pid = tl.program_id(0)
        rows, rmask = program_rows(N, BLOCK_N, GLU)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        tile_row = (pid * BLOCK_N) // GROUP_N
        w = weight_tile(w_ptrs, 0, rmask, cols, K, EVEN_K)
        wait_for_inputs(PDL)
        acc = _fp8_term(x_ptr, s_ptr, w, 0, cols, K, tile_row, stride_sn, BLOCK_SCALE, GROUP_K,
                        EVEN_K, SILU)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = weight_tile(w_ptrs, k0, rmask, cols, K, EVEN_K)
            acc += _fp8_term(x_ptr, s_ptr, w, k0, cols, K, tile_row, stride_sn, BLOCK_SCALE,
                             GROUP_K, EVEN_K, SILU)
        y = tl.sum(acc, axis=1)
        if not BLOCK_SCALE:
            y *= tl.load(s_ptr + rows * stride_sn, mask=rmask, other=0.0)
        store_rows(y_ptr, y, rows, rmask, N, BLOCK_N, GLU)

    @triton.jit
    def _fp8_skinny_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                           SPLIT, stride_xm, stride_wn, stride_ym, stride_sn,
                           BLOCK_SCALE: tl.constexpr, GROUP_N: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, PDL: tl.constexpr):
        """``y = x @ (w * scale).T`` for a few rows (M <= BLOCK_M): each program streams
        BLOCK_N rows of the FP8 weight over one of SPLIT K ranges once, widens it to bf16
        (exact) and multiplies on the tensor cores; x stays in bf16. Block format: BLOCK_K is
        the tile width along K. With SPLIT > 1 each program writes its float32 partial sums
        and counts itself in ``count`` (its N tile's counter); the last of a tile's programs
        to arrive adds the partials in split order (the same sums whoever arrives last),
        writes y and sets the counter back to 0 for the next launch."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        k_lo = pid_k * K_SPLIT
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None]
        s_row = s_ptr + (pid * BLOCK_N // GROUP_N) * stride_sn + k_lo // BLOCK_K
        # The first weight tile before the wait (under PDL, while the kernel before still
        # runs); then the same sum as a loop from zero.
        w0 = _skinny_tile(w_ptrs, 0, offs_k[:, None] < K - k_lo, nmask[None, :], EVEN_K, True)
        wait_for_inputs(PDL)
        x = _skinny_tile(x_ptrs, 0, offs_k[None, :] < K - k_lo, mmask[:, None], EVEN_K, False)
        acc = _skinny_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x, w0.to(x.dtype),
                          s_row, BLOCK_SCALE)
        for k0 in range(BLOCK_K, K_SPLIT, BLOCK_K):
            kin = offs_k < K - k_lo - k0
            x = _skinny_tile(x_ptrs, k0, kin[None, :], mmask[:, None], EVEN_K, False)
            w = _skinny_tile(w_ptrs, k0, kin[:, None], nmask[None, :], EVEN_K, True).to(x.dtype)
            acc = _skinny_dot(acc, x, w, s_row + k0 // BLOCK_K, BLOCK_SCALE)
        out_mask = mmask[:, None] & nmask[None, :]
        if SPLIT > 1:
            p_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.store(p_ptrs + pid_k * M * N, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partials written before the count
            if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == SPLIT - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for part in range(0, SPLIT):
                    acc += tl.load(p_ptrs + part * M * N, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + pid, 0)
                _scaled_store(acc, s_ptr, y_ptr, offs_m, offs_n, nmask, out_mask, stride_ym,
                              stride_sn, not BLOCK_SCALE)
        else:
            _scaled_store(acc, s_ptr, y_ptr, offs_m, offs_n, nmask, out_mask, stride_ym,
                          stride_sn, not BLOCK_SCALE)

    @triton.jit
    def _skinny_dot(acc, x, w, s_ptr, BLOCK_SCALE: tl.constexpr):
        """``acc`` plus one K tile's ``x @ w``: block format, times the tile's scale at
        ``s_ptr``; channel format, accumulated in the dot (the scales come at the end)."""
        if BLOCK_SCALE:
            return acc + tl.dot(x, w) * tl.load(s_ptr)
        return tl.dot(x, w, acc)

    @triton.jit
    def _skinny_tile(ptrs, k0, kin, other_mask, EVEN_K: tl.constexpr, WEIGHT: tl.constexpr):
        """A few-row kernel's tile at K offset ``k0`` (x's or the weight's, by the masks
        given): masked along K only where K is not whole tiles. The weight's tiles are read
        once: evicted first, so they do not push the rows out of the cache."""
        if EVEN_K:
            mask = other_mask
        else:
            mask = other_mask & kin
        if WEIGHT:
            return tl.load(ptrs + k0, mask=mask, other=0.0, eviction_policy="evict_first")
        return tl.load(ptrs + k0, mask=mask, other=0.0)

    @triton.jit
    def _scaled_store(acc, s_ptr, y_ptr, offs_m, offs_n, nmask, out_mask, stride_ym, stride_sn,
                      CHANNEL_SCALE: tl.constexpr):
        """The few-row kernel's sums, times the channel scales if CHANNEL_SCALE (block format:
        applied already), into y."""
        if CHANNEL_SCALE:
            acc *= tl.load(s_ptr + offs_n * stride_sn, mask=nmask, other=0.0)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _block_mm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, M, N, K, stride_am, stride_wn,
                         stride_cm, stride_asm, stride_wsn, GROUP_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SUPER_M: tl.constexpr):
        """``c = (a * a_scale) @ (w * w_scale).T``, a ``[M, K]`` e4m3 with one scale per row
        and K group, w ``[N, K]`` e4m3 with one scale per GROUP_N × BLOCK_K tile (BLOCK_K is
        the group size along K, BLOCK_N divides GROUP_N)."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        width = SUPER_M * grid_n  # programs sharing a band of rows of a run close together
        first_m = (pid // width) * SUPER_M
        size_m = tl.minimum(grid_m - first_m, SUPER_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m * stride_asm
        ws_ptrs = ws_ptr + (pid_n * BLOCK_N // GROUP_N) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kmask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            a_s = tl.load(as_ptrs + kb)
            w_s = tl.load(ws_ptrs + kb)
            acc += tl.dot(a, w) * a_s[:, None] * w_s
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


# -- dispatch ---------------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor, group: int | None = None):
    """:func:`quantize_rows_reference` in one Triton kernel on CUDA."""
    if not (use_triton(x) and x.dim() == 2 and x.stride(1) == 1):
        return quantize_rows_reference(x, group)
    m, k = x.shape
    width = triton.next_power_of_2(k) if group is None else group
    groups = 1 if group is None else -(-k // group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                                           GROUP=width, GROUPS_PER_ROW=groups,
                                           num_warps=4 if width <= 2048 else 8)
    return q, s


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None = None,
             config: GemvConfig = GemvConfig(block_n=4, block_k=2048),
             silu: bool = False, glu: bool = False) -> torch.Tensor:
    """One row ``x`` ``[1, K]`` (bf16/fp16) times an FP8 weight: ``[1, N]`` in x's dtype.
    ``silu``: ``x`` is a packed ``[gate | up]`` row ``[1, 2K]``, its SiLU-and-multiply computed
    in the kernel; ``glu`` (channel format): ``w`` is the packed ``[gate | up]`` projection and
    the result its SiLU-and-multiply ``[1, N / 2]`` (both as :func:`kernels.gemv.gemv`)."""
    supported = (use_triton(x) and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1
                 and w.stride(1) == 1)
    if silu and not (supported and x.shape[1] == 2 * w.shape[1]):
        return fp8_gemv(silu_and_mul(x), w, scale, block, config)
    if glu and not (supported and block is None and glu_supported(x, w, config.block_n)):
        return silu_and_mul(fp8_gemv(x, w, scale, block, config))
    if not supported:
        return fp8_gemv_reference(x, w, scale, block)
    n, k = w.shape
    group_n, group_k = block if block is not None else (config.block_n, k)
    if group_n % config.block_n:
        raise ValueError(f"fp8_gemv: block_n {config.block_n} must divide the scale tile "
                         f"height {group_n}")
    y = torch.empty((1, n // 2 if glu else n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, scale, y, n, k, w.stride(0), scale.stride(0), BLOCK_SCALE=block is not None,
        GROUP_N=group_n, GROUP_K=group_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, SILU=silu, GLU=glu, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl(x))
    return y


# Rows up to which the bf16-activation kernel beats the W8A8 GEMMs (H100, Qwen3-8B and 32B
# shapes: 3.9 against 4.7-4.9 ms of projections per 8B step at 4 and 16 rows, behind at 64).
SKINNY_MAX_ROWS = 16
# The few-row kernel's tiles and its K split (``python -m benchmarks.projections_bench fp8
# --rows 2 5 8 16`` on an H100, a grid over 2-16 rows of the Qwen3-8B and 32B FP8 projections):
# 32 weight rows by 256 columns a program, K split in 2 or 4 where the weight has too few 32-row
# tiles to keep every SM streaming (8B's qkv, o and down: 3.55 -> 3.2 ms of projections a step
# at 5 rows; 32B 15.7 -> 13.6).
SKINNY_BLOCK_N, SKINNY_BLOCK_K = 32, 256
SKINNY_MIN_PROGRAMS = 384


def skinny_split(n: int, k: int, block_n: int = SKINNY_BLOCK_N,
                 block_k: int = SKINNY_BLOCK_K) -> int:
    """How many K ranges the few-row kernel splits an ``[n, k]`` weight into: doubling (up to
    4) while its programs are fewer than :data:`SKINNY_MIN_PROGRAMS` and each range stays a
    whole number of K tiles. By shape only, so every engine sums a projection in one order."""
    split, tiles = 1, -(-n // block_n)
    while tiles * split < SKINNY_MIN_PROGRAMS and split < 4 and k % (2 * split * block_k) == 0:
        split *= 2
    return split


# Per device: the split kernel's per-tile arrival counters, zero between launches.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's counters, made (or grown) outside graph capture only: a graph captured
    with them keeps their address, so they must outlive every graph (16,384 tiles: a weight of
    524,288 rows; Qwen3's widest few-row weight, 32B's gate/up, has 1,600)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_skinny_mm: its first launch on a device (or one wider "
                               "than any before) must come before graph capture")
        if counters is not None:  # kept: graphs captured before may use it
            _RETIRED.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32,
                                                   device=device)
    return counters


_RETIRED: list = []


def fp8_skinny_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                  block: tuple[int, int] | None = None, block_n: int = SKINNY_BLOCK_N,
                  block_k: int = SKINNY_BLOCK_K, num_warps: int = 4, num_stages: int = 3,
                  split: int | None = None) -> torch.Tensor:
    """A few rows (up to :data:`SKINNY_MAX_ROWS`) times an FP8 weight, the activation kept in
    bf16/fp16 (the reference is :func:`fp8_gemv_reference`); K split as :func:`skinny_split`
    says unless ``split`` is given."""
    m, k = x.shape
    if not (use_triton(x) and 0 < m <= SKINNY_MAX_ROWS and x.stride(1) == 1
            and w.stride(1) == 1):
        return fp8_gemv_reference(x, w, scale, block)
    n = w.shape[0]
    if block is not None:
        block_k = block[1]
        if block[0] % block_n:
            block_n = block[0]
    if split is None:
        split = skinny_split(n, k, block_n, block_k)
    if split > 1 and k % (split * block_k):
        raise ValueError(f"fp8_skinny_mm: K {k} is not {split} ranges of {block_k}")
    tiles = triton.cdiv(n, block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _fp8_skinny_kernel[(tiles, split)](
        x, w, scale, y, part, _counters(x.device, tiles), m, n, k, k // split, split,
        x.stride(0), w.stride(0), y.stride(0), scale.stride(0), BLOCK_SCALE=block is not None,
        GROUP_N=block[0] if block else block_n, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % (split * block_k) == 0,
        num_warps=num_warps, num_stages=num_stages, **pdl(x))
    return y


def fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Channel format, any number of rows: per-token FP8 activations, cuBLASLt's FP8 GEMM with
    row-wise scales; bf16 out (what ``torch._scaled_mm`` takes with row-wise scales)."""
    if not use_triton(x):
        return w8a8_reference(x, w, scale)
    return fp8_scaled_rows(*quantize_rows(x), w, scale, x.dtype)


def fp8_scaled_rows(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp8_scaled_mm` of activations quantized already (the kernel before quantized its
    output: ``kernels.norm.rmsnorm_quant``, ``kernels.activation.silu_and_mul_quant``)."""
    if not xq.is_cuda:
        return scaled_rows_reference(xq, xs, w, scale, dtype)
    out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.reshape(1, -1),
                           out_dtype=torch.bfloat16)
    return out if dtype == torch.bfloat16 else out.to(dtype)


def takes_quantized_rows(m: int, block: tuple[int, int] | None,
                         gemv_config: GemvConfig | None) -> bool:
    """Whether :func:`fp8_linear` quantizes ``m`` rows per token itself (then the kernel that
    produces them can hand them over quantized: one launch and one pass over them fewer)."""
    return block is None and not (gemv_config is not None and m <= SKINNY_MAX_ROWS)


BLOCK_MM_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "SUPER_M": 8, "num_warps": 4,
                   "num_stages": 3}


def fp8_block_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int], config: dict | None = None) -> torch.Tensor:
    """Block format, any number of rows: activations quantized per 1×bk group, then the Triton
    block-scaled FP8 GEMM."""
    if not use_triton(x):
        return w8a8_reference(x, w, scale, block)
    cfg = {**BLOCK_MM_CONFIG, **(config or {})}
    bn, bk = block
    if bn % cfg["BLOCK_N"] and cfg["BLOCK_N"] % bn == 0:
        cfg["BLOCK_N"] = bn
    if bn % cfg["BLOCK_N"]:
        raise ValueError(f"fp8_block_mm: tile height {bn} is not a multiple of BLOCK_N")
    xq, xs = quantize_rows(x, bk)
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_mm_kernel[grid](xq, w, out, xs, scale, m, n, k, xq.stride(0), w.stride(0),
                           out.stride(0), xs.stride(0), scale.stride(0), GROUP_N=bn,
                           BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
                           SUPER_M=cfg["SUPER_M"], num_warps=cfg["num_warps"],
                           num_stages=cfg["num_stages"])
    return out


def fp8_block_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int]) -> torch.Tensor:
    """Block format, many rows: activations per 1×128 group, cuBLASLt's block-scaled FP8 GEMM
    through ``torch._scaled_mm`` (Hopper, CUDA 12.9+: 1×128 activation and 128×128 weight
    scales); the Triton block GEMM where that is missing."""
    if not use_triton(x):
        return w8a8_reference(x, w, scale, block)
    m, k = x.shape
    # cuBLASLt reads the weight's scales as a column-major [K/128, N/128] matrix whose leading
    # dimension must be a multiple of 4 (16 bytes): K/128 = 17 gave wrong columns, not an error.
    # Every Qwen3 projection has K a multiple of 512.
    if block != (128, 128) or k % 512 or m in _TORCH_BLOCK_REFUSED:
        return _block_fallback(x, w, scale, block)
    xq, xs = quantize_rows(x, 128)
    try:  # activation scales in column-major order, as cuBLASLt reads them
        out = torch._scaled_mm(xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=scale.t(),
                               out_dtype=torch.bfloat16)
    except RuntimeError:  # e.g. CUBLAS_STATUS_NOT_SUPPORTED (seen for one row)
        _TORCH_BLOCK_REFUSED.add(m)  # eager warm-up meets every graph's size first
        return _block_fallback(x, w, scale, block)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


# Row counts for which torch's block-wise _scaled_mm refused (cuBLASLt has no algorithm).
_TORCH_BLOCK_REFUSED: set[int] = set()


def _block_fallback(x, w, scale, block):
    if x.shape[0] <= SKINNY_MAX_ROWS:
        return fp8_skinny_mm(x, w, scale, block)
    return fp8_block_mm(x, w, scale, block)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, gemv_config: GemvConfig | None) -> torch.Tensor:
    """An FP8 linear layer's forward, by rows (chosen by ``projections_bench fp8`` on an
    H100): one row (when ``gemv_config`` is set) through the skinny matmul; channel format, a
    few rows through the bf16-activation tensor-core kernel, more through cuBLASLt's W8A8 GEMM;
    block format, cuBLASLt's block-scaled GEMM (as fast as the skinny kernel from 4 rows, 25%
    faster on Qwen3-32B)."""
    m = x.shape[0]
    if gemv_config is not None and m == 1:
        return fp8_gemv(x, w, scale, block, gemv_config)
    if block is not None:
        return fp8_block_scaled_mm(x, w, scale, block)
    if gemv_config is not None and m <= SKINNY_MAX_ROWS:
        return fp8_skinny_mm(x, w, scale, block)
    return fp8_scaled_mm(x, w, scale)


# Where the rule below is more than ~1% off for a shape's chain (``projections_bench chain
# --models dummy:Qwen3-<size>:fp8 --grid`` on an H100), ``(n, k) -> (block_n, block_k, warps,
# stages)``: the Qwen3-32B projections (its down projection alone: 12.00 -> 11.66 ms a step)
# and the 0.6B ones (a draft model's: 465 -> 402 us a step; its head takes the rule).
FP8_CHAIN_WINNERS = {
    (10240, 5120): (4, 1024, 4, 2), (5120, 8192): (2, 2048, 4, 2),  # 32B qkv, o
    (51200, 5120): (4, 1024, 4, 2), (5120, 25600): (2, 2048, 4, 2),  # 32B gate/up, down
    (4096, 1024): (4, 512, 4, 2), (1024, 2048): (4, 2048, 4, 2),  # 0.6B qkv, o
    (6144, 1024): (8, 512, 8, 2), (1024, 3072): (4, 4096, 8, 2),  # 0.6B gate/up, down
}


def fp8_gemv_config(n: int, k: int) -> GemvConfig:
    """Tile config of the one-row FP8 kernel for an ``[n, k]`` weight (by shape, so every
    engine sums in the same order): :data:`FP8_CHAIN_WINNERS` for the shapes there, else the
    winners of ``projections_bench chain --grid`` on an H100 for the Qwen3-8B projections
    chained as a step runs them, under programmatic dependent launch: projections wider than
    deep (qkv, gate/up) 16 rows of 512 FP8 bytes a program, the others (o, down) 4 rows of 2048.
    16, 4 and 2 divide the 128-row scale tiles of Qwen's FP8 checkpoints."""
    if (n, k) in FP8_CHAIN_WINNERS:
        return GemvConfig(*FP8_CHAIN_WINNERS[n, k])
    if n > k:
        return GemvConfig(block_n=16, block_k=512, num_warps=8, num_stages=2)
    return GemvConfig(block_n=4, block_k=2048, num_warps=8, num_stages=2)
