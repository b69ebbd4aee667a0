"""A model source (:mod:`engine.model_source`: a folder, a repo id in the Hugging Face cache,
``dummy:Qwen3-<size>``, ``tiny``) → a Qwen3 model on its device.

The model is built on the meta device, materialised on the target device, filled from
safetensors (cast to the target dtype on load), and its RoPE cache is built afterwards.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.model_source import ModelSource
from engine.models.qwen3 import PACKED_MODULES, Qwen3ForCausalLM
from engine.parallel import tp
from engine.quantization import (Fp8Scheme, fill_shard, init_random, mark_quantized,
                                 resolve_scheme)
from kernels.fp8 import fp8_supported

log = logging.getLogger(__name__)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PROJECTIONS_WEIGHTS = tuple(f"{p}.weight" for p in PROJECTIONS)



def load_model(source: ModelSource, device: torch.device, dtype: torch.dtype,
               seed: int = 0, progress: bool = False,
               quantization: str | None = None) -> Qwen3ForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill it. ``quantization="fp8"`` quantizes
    a plain checkpoint's decoder projections at load; an FP8 checkpoint needs no flag
    (:mod:`engine.quantization`)."""
    scheme = resolve_scheme(source.config.quantization, quantization, source.name)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(source.config)
    model = model.to(dtype)
    model.quantization = scheme
    if scheme is not None:
        native = fp8_supported(device) and dtype == torch.bfloat16
        _mark_fp8(model, scheme, native)
        log.info("FP8 weights: %s, %s", scheme.name,
                 "FP8 kernels" if native else f"dequantized to {str(dtype)[6:]} at load "
                 "(no FP8 matmuls on this device or dtype)")
    model = model.to_empty(device=device)
    if source.is_dummy:
        _init_random(model, seed)
    else:
        load_weights(model, source.path, progress)
    model.model.rope.build(device)
    return model.eval().requires_grad_(False)


def _mark_fp8(model: Qwen3ForCausalLM, scheme: Fp8Scheme, native: bool) -> None:
    for name, linear in model.named_modules():
        if not name.endswith(PROJECTIONS):
            continue
        shards = checkpoint_modules(name)
        quantized = [scheme.quantizes(s) for s in shards]
        if all(quantized):
            mark_quantized(linear, scheme, native)
        elif any(quantized):
            raise ValueError(f"model: the quantization config quantizes only some of "
                             f"{shards}, which Baton packs into one layer")


def checkpoint_modules(name: str) -> list[str]:
    """Our (possibly packed) module → the checkpoint modules it holds, in shard order."""
    prefix, _, ours = name.rpartition(".")
    parts = sorted((shard, ckpt) for ckpt, (packed, shard) in PACKED_MODULES.items()
                   if packed == ours)
    return [f"{prefix}.{ckpt}" for _, ckpt in parts] or [name]


def _init_random(model: Qwen3ForCausalLM, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".weight_scale"):
            continue  # set with its weight
        if name.endswith(PROJECTIONS_WEIGHTS):
            init_random(model.get_submodule(name.removesuffix(".weight")), gen)
        elif name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    return files


def _target(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name → (our parameter name, shard index or None)."""
    for ckpt, (ours, shard) in PACKED_MODULES.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{ours}."), shard
    return name, None


# Tensors that travel with a weight (its scales), read when the weight is; static activation
# scales are refused by the quantization config before loading (none are read).
_COMPANIONS = (".weight_scale_inv", ".weight_scale", ".input_scale", ".k_scale", ".v_scale")


def load_weights(model: Qwen3ForCausalLM, path: Path, progress: bool = False) -> None:
    params = dict(model.named_parameters())
    expected = {n for n in params if not n.endswith(".weight_scale")}
    filled: dict[str, set[int | None]] = {}
    unexpected: list[str] = []
    files = _checkpoint_files(path)
    where = {}  # tensor name -> file, for a weight's scale stored in another shard
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    for file in tqdm(files, desc="loading safetensors shards", unit="shard",
                     disable=not progress, leave=False):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
                    attn, _, which = name.rpartition(".")  # an FP8 KV cache's calibrated scale
                    setattr(model.get_submodule(attn), which, float(f.get_tensor(name)))
                    continue
                if name.endswith(_COMPANIONS):
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied checkpoints may still store the head
                ours, shard = _target(name)
                param = params.get(ours)
                if param is None:
                    unexpected.append(name)
                    continue
                tensor = _read(f, name, ours, shard, param, model)
                module_name = ours.rsplit(".", 1)[0]
                if module_name.endswith(PROJECTIONS):
                    linear = model.get_submodule(module_name)
                    sizes = _shard_sizes(model, ours)
                    start = 0 if shard is None else sum(sizes[:shard])
                    count = param.shape[0] if shard is None else sizes[shard]
                    fill_shard(linear, slice(start, start + count), tensor,
                               _scale_of(name, ours, linear, where, count), name)
                else:
                    _copy_shard(param, tensor, name)
                filled.setdefault(ours, set()).add(shard)
    missing = []
    for name in sorted(expected):
        want = {None} if _shard_sizes(model, name) is None else set(
            range(len(_shard_sizes(model, name))))
        if filled.get(name, set()) != want:
            missing.append(name)
    if missing or unexpected:
        raise ValueError(f"model: checkpoint {path} does not match Qwen3 "
                         f"(missing: {missing or 'none'}; unexpected: {unexpected or 'none'})")


# Under tensor parallelism: the parameters split by rows (column-parallel projections, the
# vocabulary) and by columns (row-parallel projections); the rest is whole on every rank.
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
_BY_ROWS = ("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")


def _read(f, name: str, ours: str, shard: int | None, param: torch.Tensor, model) -> torch.Tensor:
    """The checkpoint tensor, or only this rank's slice of it (read as a slice: no rank holds
    a whole copy of a split weight)."""
    size, rank = tp().size, tp().rank
    if size == 1 or not ours.endswith(_ROW_PARALLEL + _BY_ROWS):
        return f.get_tensor(name)
    part = f.get_slice(name)
    if ours.endswith(_ROW_PARALLEL):
        n = param.shape[1]
        return part[:, rank * n:(rank + 1) * n]
    sizes = _shard_sizes(model, ours)
    n = param.shape[0] if shard is None else sizes[shard]
    return part[rank * n:(rank + 1) * n]


def _scale_of(name: str, ours: str, linear, where: dict[str, Path],
              rows: int) -> torch.Tensor | None:
    """The scale tensor stored beside an FP8 weight (None if the layer is not FP8 or the
    checkpoint has none); under tensor parallelism this rank's part of it, for the ``rows``
    output rows this rank holds of the weight: per-channel scales split with the rows of a
    column-parallel layer and stay whole for a row-parallel one; 128x128 block scales split
    by tiles, so a rank's rows (or columns) must be whole tiles."""
    scheme = getattr(linear, "fp8_scheme", None)
    if scheme is None or not scheme.from_checkpoint:
        return None
    scale_name = name.removesuffix("weight") + scheme.scale_name
    file = where.get(scale_name)
    if file is None:
        return None
    with safe_open(str(file), framework="pt") as f:
        scale = f.get_tensor(scale_name)
    size, rank = tp().size, tp().rank
    if size == 1 or scale.numel() == 1:  # one rank, or one scale for the whole tensor
        return scale
    row_parallel = ours.endswith(_ROW_PARALLEL)
    if scheme.block is None:
        return scale if row_parallel else scale.reshape(-1, 1)[rank * rows:(rank + 1) * rows]
    tile = scheme.block[1] if row_parallel else scheme.block[0]
    n = linear.weight.shape[1] if row_parallel else rows
    if n % tile:
        what = "columns" if row_parallel else "rows"
        raise ValueError(f"tensor_parallel_size: {size} gives each rank {n} {what} of {name}, "
                         f"not a multiple of its {tile}-wide FP8 scale tiles")
    n //= tile
    return scale[:, rank * n:(rank + 1) * n] if row_parallel else scale[rank * n:(rank + 1) * n]


def _shard_sizes(model: Qwen3ForCausalLM, param_name: str) -> tuple[int, ...] | None:
    module = model.get_submodule(param_name.rsplit(".", 2)[0])
    return getattr(module, "shard_sizes", None) if param_name.endswith(
        ("qkv_proj.weight", "gate_up_proj.weight")) else None


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"model: tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(tensor)
