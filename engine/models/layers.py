"""Building blocks: linear projections, RMSNorm (with fused residual add) and the rotary
embedding's cos/sin cache; the arithmetic lives in :mod:`kernels`."""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel import all_reduce, split, tp
from kernels import rmsnorm
from kernels.fp8 import fp8_gemv, fp8_linear, fp8_scaled_rows, takes_quantized_rows
from kernels.norm import rmsnorm_quant
from kernels.gemv import GemvConfig, gemv, norm_gemv


class Linear(nn.Linear):
    """``nn.Linear`` (no bias here) whose one-row calls run the Triton skinny matmul when
    ``gemv_config`` is set (by the model runner on CUDA, :mod:`kernels.gemv`), with the norm in
    front folded in when ``fuse_norm`` (:func:`norm_then`).

    FP8 (:mod:`engine.quantization`): the weight is e4m3 and ``weight_scale`` holds its scales
    (per output channel, or per ``fp8_block`` tile); :func:`kernels.fp8.fp8_linear` runs it."""

    gemv_config: GemvConfig | None = None
    fuse_norm: bool = False
    fp8_block: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_parameter("weight_scale", None)

    def reset_parameters(self) -> None:
        """No initialisation: the loader fills every weight. (On the meta device torch's
        initialisers run Python decompositions that import TorchDynamo, and with it Triton,
        whose bindings report leaks at interpreter exit.)"""

    def forward(self, x: torch.Tensor, glu: bool = False) -> torch.Tensor:
        """``glu`` (one row, ``gemv_config`` set): this is a packed ``[gate | up]`` projection
        and the result its SiLU-and-multiply, computed in the one-row kernel's epilogue
        (:func:`kernels.gemv.gemv`)."""
        if glu:
            if self.weight_scale is not None:
                return fp8_gemv(x, self.weight, self.weight_scale, self.fp8_block,
                                self.gemv_config, glu=True)
            return gemv(x, self.weight, self.gemv_config, glu=True)
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.fp8_block, self.gemv_config)
        if self.gemv_config is not None and x.shape[0] == 1:
            return gemv(x, self.weight, self.gemv_config)
        return nn.functional.linear(x, self.weight, self.bias)

    def forward_silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The forward of one row's SiLU-and-multiply of a packed ``[gate | up]`` row, the
        activation computed inside the one-row kernel (only where ``gemv_config`` is set)."""
        if self.weight_scale is not None:
            return fp8_gemv(gate_up, self.weight, self.weight_scale, self.fp8_block,
                            self.gemv_config, silu=True)
        return gemv(gate_up, self.weight, self.gemv_config, silu=True)

    def takes_quantized(self, rows: int) -> bool:
        """Whether this FP8 projection would quantize ``rows`` rows per token itself: then the
        kernel producing them quantizes them instead (:meth:`forward_quantized`)."""
        return self.weight_scale is not None and takes_quantized_rows(rows, self.fp8_block,
                                                                      self.gemv_config)

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
        """The forward of rows already quantized per token (e4m3 ``xq``, scales ``xs``), in
        ``dtype``; only where :meth:`takes_quantized`."""
        return fp8_scaled_rows(xq, xs, self.weight, self.weight_scale, dtype)


def norm_then(proj: Linear, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
              residual_out: torch.Tensor | None = None, glu: bool = False):
    """``proj(norm(x [+ residual]))`` and the new residual (``x`` when there is none yet), the
    latter written into ``residual_out`` when given (a piecewise graph's static buffer): one
    kernel for a row when ``proj.fuse_norm``; the norm writing its rows quantized where an FP8
    projection would quantize them (:meth:`Linear.takes_quantized`); else the norm kernel and
    the projection (``glu``: :meth:`Linear.forward`'s, only where neither fold applies)."""
    if residual is None and residual_out is not None:
        x = residual_out.copy_(x)  # the first layer's residual is its input
    elif proj.fuse_norm and x.shape[0] == 1:
        out, residual = norm_gemv(x, residual, norm.weight, norm.eps, proj.weight,
                                  proj.gemv_config)
        return out, (residual if residual_out is None else residual_out.copy_(residual))
    if proj.takes_quantized(x.shape[0]):
        xq, xs, residual = rmsnorm_quant(x, norm.weight, norm.eps, residual, residual_out)
        return proj.forward_quantized(xq, xs, x.dtype), residual
    if residual is None:
        return proj(norm(x), glu=glu), x
    x, residual = norm(x, residual, residual_out)
    return proj(x, glu=glu), residual


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding`` without initialisation (see :meth:`Linear.reset_parameters`); under
    tensor parallelism each rank holds its rows of the vocabulary (:class:`VocabEmbedding`)."""
    if tp().size > 1:
        return VocabEmbedding(num, dim)
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class VocabEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of a vocabulary-parallel embedding: ids outside
    them look up zeros, and the sum over the group is every id's row."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.group = tp()
        self.rows = split(num, "vocabulary")
        self.start = self.group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = nn.functional.embedding(local.clamp(0, self.rows - 1), self.weight)
        return all_reduce(out * inside.unsqueeze(-1).to(out.dtype), self.group)


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it; ``forward(x, residual)`` adds first and returns
    ``(normed, new_residual)`` (one fused kernel on CUDA, see :mod:`kernels.norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None):
        return rmsnorm(x, self.weight, self.eps, residual, residual_out)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate half): the cos/sin cache, built after the model is on its device.

    The cache is a plain attribute, not a buffer, so ``to_empty`` from the meta device cannot leave
    it uninitialised; call :meth:`build` once the module is on its device.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.cos_sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(device, torch.float)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        t = torch.arange(self.max_positions, device=device, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, head_dim] float32
