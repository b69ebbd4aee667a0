"""SiLU-and-multiply of a packed ``[gate | up]`` projection, as transformers computes it:
``silu(gate)`` rounded to the activation dtype, then multiplied by ``up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton, use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n, x_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not use_triton(x) or x.dim() != 2 or x.stride(1) != 1:
        return silu_and_mul_reference(x)
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), BLOCK=block,
                                                            num_warps=4)
    return out
