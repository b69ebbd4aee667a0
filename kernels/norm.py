"""RMSNorm, alone or with the residual add fused in front of it.

The arithmetic is transformers' Qwen3RMSNorm: the sum (when a residual is given) is rounded to
the activation dtype and becomes the new residual; the norm runs in float32, is rounded back to
the activation dtype, then multiplied by the weight in that dtype. The Triton kernel does one
read of each input and one write of each output per row.
"""

from __future__ import annotations

import torch

from kernels._triton import num_warps_for, pdl, tl, triton, use_triton, wait_for_inputs
from kernels.fp8_base import FP8, quantize_rows_reference


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None):
    """``x``: ``[..., dim]``. Returns ``normed``, or ``(normed, x + residual)`` with a residual."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed if residual is None else (normed, x)


if triton is not None:
    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, n_cols, x_stride,
                        res_stride, eps, HAS_RES: tl.constexpr, QUANT: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
        """QUANT: ``out`` is e4m3, the normed row (rounded as unquantized) over its per-row
        scale, stored in ``s`` (as ``kernels.fp8.quantize_rows`` would make of it)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wait_for_inputs(PDL)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        dtype = x.dtype
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * rstd).to(dtype).to(tl.float32) * w
        if QUANT:
            y = y.to(dtype).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1e-12)
            q = tl.clamp(y / scale, -448.0, 448.0)
            tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + row, scale)
        else:
            tl.store(out_ptr + row * n_cols + cols, y.to(dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """Dispatch: Triton on CUDA, else the reference. Same contract as the reference; with a
    residual, the new one is written into ``residual_out`` when given (row by row: it may be
    ``residual`` itself)."""
    if not use_triton(x) or x.dim() != 2 or weight.dtype != x.dtype:
        out = rmsnorm_reference(x, weight, eps, residual)
        if residual is None or residual_out is None:
            return out
        return out[0], residual_out.copy_(out[1])
    return _launch(x, weight, eps, residual, quant=False, residual_out=residual_out)


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None):
    """The normed rows quantized per row for an FP8 projection: ``(q, scale, new_residual)``
    (``new_residual`` is ``x`` without a residual), what :func:`rmsnorm` then
    ``kernels.fp8.quantize_rows`` give."""
    out = rmsnorm_reference(x, weight, eps, residual)
    normed, res = out if residual is not None else (out, x)
    return (*quantize_rows_reference(normed), res)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None,
                  residual_out: torch.Tensor | None = None):
    """:func:`rmsnorm_quant_reference` in one kernel on CUDA: the norm's output is written as
    e4m3 with its scale, never in bf16 (the quantization's own launch and pass saved). With a
    residual, the new one goes into ``residual_out`` when given."""
    if not use_triton(x) or x.dim() != 2 or weight.dtype != x.dtype:
        q, s, res = rmsnorm_quant_reference(x, weight, eps, residual)
        if residual is None or residual_out is None:
            return q, s, res
        return q, s, residual_out.copy_(res)
    return _launch(x, weight, eps, residual, quant=True, residual_out=residual_out)


def _launch(x, weight, eps, residual, quant: bool, residual_out=None):
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=FP8 if quant else x.dtype, device=x.device)
    if residual is None:
        res_out = out
    else:
        res_out = residual_out if residual_out is not None else torch.empty(
            (rows, n), dtype=x.dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quant else out
    if rows:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out, scale, n,
            x.stride(0), residual.stride(0) if residual is not None else 0, eps,
            HAS_RES=residual is not None, QUANT=quant, BLOCK=block,
            num_warps=num_warps_for(block), **pdl(x))
    if quant:
        return out, scale, (res_out if residual is not None else x)
    return out if residual is None else (out, res_out)
