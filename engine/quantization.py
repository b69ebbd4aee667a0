"""FP8 weights: which checkpoint formats load, and how a linear layer holds them.

Quantization is a property of a linear layer (its weight, its scales, its kernel), chosen at load;
the model code does not change. Sources, as vLLM reads them:

- Qwen's own FP8 checkpoints: ``quantization_config`` with ``quant_method: "fp8"``, e4m3
  weights, one ``weight_scale_inv`` per 128×128 tile (``weight_block_size``), dynamic activations;
- llm-compressor's ``compressed-tensors`` FP8 (``float-quantized``): e4m3 weights with a
  ``weight_scale`` per output channel (or one per tensor), dynamic per-token activations, an
  ``ignore`` list of layers left in the checkpoint's dtype;
- ``quantization="fp8"`` on a bf16 checkpoint (or a ``dummy:`` model): per-channel scales
  computed at load, as ``vllm serve --quantization fp8`` does.

The four projections of every decoder layer are quantized (packed qkv and gate/up keep each
shard's scales); embeddings, norms and the LM head stay in the model's dtype. On a device
without FP8 matmuls (:func:`kernels.fp8.fp8_supported`) the weights are dequantized to the
compute dtype at load, so a CPU run computes exactly on the dequantized weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the kernels load where weights are made, not where configs are read
    import torch
    from torch import nn

QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers hold FP8 weights.

    ``block``: the scale tile ``(rows, cols)``, or None for one scale per output channel.
    ``from_checkpoint``: the checkpoint stores e4m3 weights with scales named
    ``<module>.<scale_name>``; otherwise bf16/fp32 weights are quantized at load.
    ``ignore``: checkpoint module names (or ``re:`` patterns) left unquantized.
    """

    source: str  # "fp8" (Qwen), "compressed-tensors" or "on-the-fly"
    block: tuple[int, int] | None = None
    from_checkpoint: bool = False
    scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """What a replica reports (``/v1/models``, metrics)."""
        fmt = f"block{self.block[0]}x{self.block[1]}" if self.block else "channel"
        return f"fp8 ({self.source}, {fmt})"

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``) is
        FP8."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or module.endswith("." + entry):
                return False
        return True


ON_THE_FLY = Fp8Scheme(source="on-the-fly")


def parse_quantization_config(raw: dict | None, source: str = "config") -> Fp8Scheme | None:
    """``config.json``'s ``quantization_config`` → the scheme, or a clear error for what Baton
    does not run."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "fp8":
        return _qwen_fp8(raw, source)
    if method == "compressed-tensors":
        return _compressed_tensors(raw, source)
    raise ValueError(f"{source}: quantization {method!r} is not supported; Baton loads FP8 "
                     "checkpoints (quant_method 'fp8' or 'compressed-tensors' float-quantized)")


def _qwen_fp8(raw: dict, source: str) -> Fp8Scheme:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: FP8 format {raw.get('fmt')!r} is not supported (e4m3 only)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{source}: static activation scales are not supported; Baton "
                         "quantizes activations dynamically (activation_scheme 'dynamic')")
    block = raw.get("weight_block_size")
    ignore = tuple(raw.get("modules_to_not_convert") or ())
    if block is None:  # one scale per tensor, stored as weight_scale
        return Fp8Scheme("fp8", None, True, "weight_scale", ignore)
    if len(block) != 2:
        raise ValueError(f"{source}: weight_block_size {block} is not [rows, cols]")
    return Fp8Scheme("fp8", (int(block[0]), int(block[1])), True, "weight_scale_inv", ignore)


def _compressed_tensors(raw: dict, source: str) -> Fp8Scheme:
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"{source}: compressed-tensors with {len(groups)} config groups; "
                         "Baton loads one FP8 group over the Linear layers")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        raise ValueError(f"{source}: compressed-tensors weights {weights.get('type')}/"
                         f"{weights.get('num_bits')} bits are not supported (FP8 only)")
    if acts is None or (acts.get("type"), acts.get("num_bits")) != ("float", 8):
        raise ValueError(f"{source}: compressed-tensors without FP8 activations (weight-only) "
                         "is not supported; Baton runs W8A8 with dynamic activation scales")
    if not acts.get("dynamic", False):
        raise ValueError(f"{source}: static activation scales are not supported; Baton "
                         "quantizes activations dynamically (llm-compressor's FP8_DYNAMIC)")
    strategy = weights.get("strategy")
    ignore = tuple(raw.get("ignore") or ())
    if strategy in ("channel", "tensor"):
        return Fp8Scheme("compressed-tensors", None, True, "weight_scale", ignore)
    if strategy == "block":
        block = weights.get("block_structure") or [128, 128]
        return Fp8Scheme("compressed-tensors", (int(block[0]), int(block[1])), True,
                         "weight_scale", ignore)
    raise ValueError(f"{source}: compressed-tensors weight strategy {strategy!r} is not "
                     "supported (channel, tensor or block)")


def resolve_scheme(checkpoint: Fp8Scheme | None, requested: str | None,
                   model: str) -> Fp8Scheme | None:
    """The scheme an engine runs: the checkpoint's own, or ``quantization="fp8"`` at load."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization: {requested!r} is not supported; use one of "
                         f"{list(QUANTIZATIONS)} or leave it unset")
    if checkpoint is not None:
        return checkpoint  # "fp8" on an FP8 checkpoint is the checkpoint's own FP8
    return ON_THE_FLY if requested == "fp8" else None


# -- linear layers ----------------------------------------------------------------------------
def mark_quantized(linear: nn.Module, scheme: Fp8Scheme, native: bool) -> None:
    """Mark a (meta-device) decoder projection as FP8 under ``scheme``. ``native``: hold the
    weight in e4m3 with a float32 scale parameter and run FP8 kernels; otherwise the layer stays
    in the compute dtype and the loader writes dequantized values into it."""
    linear.fp8_scheme = scheme
    if not native:
        return
    import torch
    from torch import nn

    from kernels.fp8 import FP8
    n, k = linear.weight.shape
    if scheme.block is None:
        scale_shape = (n, 1)
    else:
        bn, bk = scheme.block
        scale_shape = (-(-n // bn), -(-k // bk))
    device = linear.weight.device
    linear.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device),
                                 requires_grad=False)
    linear.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32,
                                                   device=device), requires_grad=False)
    linear.fp8_block = scheme.block


def fill_shard(linear: nn.Module, rows: slice, tensor: torch.Tensor,
               scale: torch.Tensor | None, name: str) -> None:
    """Write one checkpoint tensor, rows ``rows`` of the layer's weight (a shard of a packed
    layer, or all of it), into ``linear``: as it is; dequantized (an FP8 tensor into a layer in
    the compute dtype); or quantized per output channel (a bf16 tensor into an FP8 layer, or the
    same rounding simulated in a layer in the compute dtype)."""
    from kernels.fp8 import FP8, dequantize, quantize_per_channel

    scheme: Fp8Scheme | None = getattr(linear, "fp8_scheme", None)
    target = linear.weight.data[rows]
    if target.shape != tensor.shape:
        raise ValueError(f"model: tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    if tensor.dtype == FP8 and (scheme is None or scale is None):
        raise ValueError(f"model: FP8 tensor {name} has no scale in the checkpoint"
                         if scheme is not None else
                         f"model: tensor {name} is FP8 but the quantization config leaves "
                         "its layer unquantized")
    native = getattr(linear, "weight_scale", None) is not None
    if tensor.dtype == FP8:
        if native:
            target.copy_(tensor)
            _fill_scale(linear, rows, scale, scheme, name)
        else:
            target.copy_(dequantize(tensor, scale, scheme.block))
        return
    if scheme is None:
        target.copy_(tensor)
        return
    q, s = quantize_per_channel(tensor.to(target.device))  # quantized at load
    if native:
        target.copy_(q)
        linear.weight_scale.data[rows].copy_(s)
    else:
        target.copy_(dequantize(q, s))  # the values an FP8 layer would hold


def _fill_scale(linear: nn.Module, rows: slice, scale: torch.Tensor, scheme: Fp8Scheme,
                name: str) -> None:
    dst = linear.weight_scale.data
    if scheme.block is None:
        count = rows.stop - rows.start
        if scale.numel() not in (1, count):
            raise ValueError(f"model: scale of {name} has {scale.numel()} values, expected 1 "
                             f"or {count}")
        dst[rows].copy_(scale.float().reshape(-1, 1).expand(count, 1))
        return
    bn = scheme.block[0]
    if rows.start % bn:
        raise ValueError(f"model: {name} starts at row {rows.start} of a packed layer, inside "
                         f"a {bn}-row scale tile; its FP8 shards cannot be packed")
    tiles = slice(rows.start // bn, rows.start // bn + scale.shape[0])
    if dst[tiles].shape != scale.shape:
        raise ValueError(f"model: scale of {name} has shape {tuple(scale.shape)}, expected "
                         f"{tuple(dst[tiles].shape)}")
    dst[tiles].copy_(scale)


def init_random(linear: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Random weights for a ``dummy:`` model's layer: normal, quantized per channel when the
    layer is FP8 (in e4m3, or simulated in the compute dtype)."""
    import torch

    if getattr(linear, "fp8_scheme", None) is None:
        linear.weight.data.normal_(0.0, std, generator=generator)
        return
    w = torch.empty(linear.weight.shape, dtype=torch.bfloat16, device=linear.weight.device)
    fill_shard(linear, slice(0, w.shape[0]), w.normal_(0.0, std, generator=generator), None,
               "random weight")
