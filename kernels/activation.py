"""SiLU-and-multiply of a packed ``[gate | up]`` projection, as transformers computes it:
``silu(gate)`` rounded to the activation dtype, then multiplied by ``up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import pdl, tl, triton, use_triton, wait_for_inputs
from kernels.fp8_base import FP8, quantize_rows_reference


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def silu_mul(row_ptr, cols, mask, n, EVEN: tl.constexpr):
        """``silu(gate) * up`` at ``cols`` of a packed ``[gate | up]`` row (each ``n`` wide), in
        the activation dtype and rounded as transformers rounds it; EVEN: no column is masked.
        Every kernel that computes the activation (here and ``kernels.gemv``) calls this."""
        if EVEN:
            gate = tl.load(row_ptr + cols)
            up = tl.load(row_ptr + n + cols)
        else:
            gate = tl.load(row_ptr + cols, mask=mask, other=0.0)
            up = tl.load(row_ptr + n + cols, mask=mask, other=0.0)
        return silu_times(gate, up)

    @triton.jit
    def silu_times(gate, up):
        """``silu(gate) * up`` of values in the activation dtype, rounded as transformers
        rounds it (``silu(gate)`` to the dtype, then the product): :func:`silu_mul`'s
        arithmetic, also the one-row gate/up projection's epilogue (``kernels.gemv``)."""
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        return (act * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n, x_stride, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        y = silu_mul(x_ptr + row * x_stride, cols, mask, n, False)
        tl.store(out_ptr + row * n + cols, y, mask=mask)


    @triton.jit
    def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, n, x_stride, BLOCK: tl.constexpr,
                                   ONE_PASS: tl.constexpr):
        """One program a row. ONE_PASS (the row fits ``BLOCK``): the row's activations in
        registers, their largest magnitude, then e4m3 over the row's scale. Otherwise the
        largest magnitude in a first pass over blocks, the activations again in a second."""
        row = tl.program_id(0).to(tl.int64)
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = cols < n
            y = silu_mul(x_ptr + row * x_stride, cols, mask, n, False).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1e-12)
            q = tl.clamp(y / scale, -448.0, 448.0)
            tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + row, scale)
            return
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n
            y = silu_mul(x_ptr + row * x_stride, cols, mask, n, False).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(y))
        scale = tl.maximum(tl.max(peak, axis=0) / 448.0, 1e-12)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n
            y = silu_mul(x_ptr + row * x_stride, cols, mask, n, False).to(tl.float32)
            q = tl.clamp(y / scale, -448.0, 448.0)
            tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)


ONE_PASS_MAX = 16384  # the widest row one program holds in registers (Qwen3-8B's 12,288)


def silu_and_mul_quant_reference(x: torch.Tensor):
    """SiLU-and-multiply quantized per row for an FP8 projection: ``(q, scale)``, what
    :func:`silu_and_mul` then ``kernels.fp8.quantize_rows`` give."""
    return quantize_rows_reference(silu_and_mul_reference(x))


def silu_and_mul_quant(x: torch.Tensor):
    """:func:`silu_and_mul_quant_reference` in one kernel on CUDA (the activations are written
    once, as e4m3, instead of in bf16 and read back by the quantization)."""
    if not use_triton(x) or x.dim() != 2 or x.stride(1) != 1:
        return silu_and_mul_quant_reference(x)
    rows, n = x.shape[0], x.shape[1] // 2
    q = torch.empty((rows, n), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        width = triton.next_power_of_2(n)
        one_pass = width <= ONE_PASS_MAX
        _silu_and_mul_quant_kernel[(rows,)](
            x, q, scale, n, x.stride(0), BLOCK=width if one_pass else 2048, ONE_PASS=one_pass,
            num_warps=16 if one_pass and width >= 8192 else 8)
    return q, scale


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not use_triton(x) or x.dim() != 2 or x.stride(1) != 1:
        return silu_and_mul_reference(x)
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), BLOCK=block,
                                                            num_warps=4, **pdl(x))
    return out
