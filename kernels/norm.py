"""RMSNorm, alone or with the residual add fused in front of it.

The arithmetic is transformers' Qwen3RMSNorm: the sum (when a residual is given) is rounded to
the activation dtype and becomes the new residual; the norm runs in float32, is rounded back to
the activation dtype, then multiplied by the weight in that dtype. The Triton kernel does one
read of each input and one write of each output per row.
"""

from __future__ import annotations

import torch

from kernels._triton import num_warps_for, tl, triton, use_triton


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
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_stride,
                        res_stride, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        dtype = x.dtype
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (xf * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_ptr + row * n_cols + cols, y.to(dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None):
    """Dispatch: Triton on CUDA, else the reference. Same contract as the reference."""
    if not use_triton(x) or x.dim() != 2 or weight.dtype != x.dtype:
        return rmsnorm_reference(x, weight, eps, residual)
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out, n, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=num_warps_for(block))
    return out if residual is None else (out, res_out)
