"""Model specs → a Qwen3 model on its device, plus the tokenizer when the model has one.

Specs: a path to an HF folder; a Hugging Face repo id (``Qwen/Qwen3-8B``) already in the local
Hugging Face cache (read only: nothing is ever downloaded); ``dummy:Qwen3-<size>`` (random
weights, real config); ``tiny`` (a small random checkpoint with a trained tokenizer, generated
once, see ``engine.tiny``).
The model is built on the meta device, materialised on the target device, filled from
safetensors (cast to the target dtype on load), and its RoPE cache is built afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import ModelConfig
from engine.models.qwen3 import PACKED_MODULES, Qwen3ForCausalLM
from engine.quantization import (Fp8Scheme, fill_shard, init_random, mark_quantized,
                                 resolve_scheme)
from kernels.fp8 import fp8_supported

log = logging.getLogger(__name__)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PROJECTIONS_WEIGHTS = tuple(f"{p}.weight" for p in PROJECTIONS)

DUMMY_PREFIX = "dummy:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    config: ModelConfig
    path: Path | None  # None for dummy models
    repo_id: str | None = None  # found in the Hugging Face cache under this id

    @property
    def model_id(self) -> str:
        """A name that is the same wherever the model's folder sits."""
        if self.repo_id is not None:
            return self.repo_id
        return self.name if self.path is None else self.path.name

    @property
    def is_dummy(self) -> bool:
        return self.path is None

    @property
    def has_tokenizer(self) -> bool:
        return self.path is not None and any((self.path / f).exists() for f in TOKENIZER_FILES)


def dummy_names() -> list[str]:
    folder = resources.files("engine") / "model_configs"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def resolve_model(spec: str) -> ModelSource:
    if spec == "tiny":
        from engine.tiny import ensure_tiny_model
        spec = str(ensure_tiny_model())
    if spec.startswith(DUMMY_PREFIX):
        name = spec[len(DUMMY_PREFIX):]
        if name not in dummy_names():
            raise ValueError(f"model: unknown dummy model {name!r}; choose from {dummy_names()}")
        raw = json.loads((resources.files("engine") / "model_configs" / f"{name}.json").read_text())
        return ModelSource(spec, ModelConfig.from_dict(raw, source=spec), None)
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return ModelSource(spec, ModelConfig.from_file(path / "config.json"), path)
    if REPO_ID.fullmatch(spec) and not path.exists():
        snapshot, looked = find_in_hf_cache(spec)
        if snapshot is None:
            raise ValueError(f"model: {spec!r} is not a folder and not in the Hugging Face cache "
                             f"(looked in {looked}); Baton never downloads: fetch it first "
                             f"(`huggingface-cli download {spec}`) or pass a folder")
        return ModelSource(spec, ModelConfig.from_file(snapshot / "config.json"), snapshot,
                           repo_id=spec)
    raise ValueError(f"model: {spec!r} is not 'tiny', 'dummy:Qwen3-<size>', a folder holding "
                     "config.json or a Hugging Face repo id in the local cache")


REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hf_cache_dir() -> Path:
    """Where the Hugging Face hub keeps downloads: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``
    (``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def find_in_hf_cache(repo_id: str) -> tuple[Path | None, Path]:
    """The snapshot folder of ``repo_id`` in the local cache (the revision ``refs/main`` names,
    else the newest snapshot holding config.json) and where it looked."""
    folder = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    ref = folder / "refs" / "main"
    if ref.is_file():
        snapshot = folder / "snapshots" / ref.read_text().strip()
        if (snapshot / "config.json").is_file():
            return snapshot, folder
    snapshots = sorted((p for p in (folder / "snapshots").glob("*") if (p / "config.json")
                        .is_file()), key=lambda p: p.stat().st_mtime)
    return (snapshots[-1] if snapshots else None), folder


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
                tensor = f.get_tensor(name)
                module_name = ours.rsplit(".", 1)[0]
                if module_name.endswith(PROJECTIONS):
                    linear = model.get_submodule(module_name)
                    sizes = _shard_sizes(model, ours)
                    start = 0 if shard is None else sum(sizes[:shard])
                    count = param.shape[0] if shard is None else sizes[shard]
                    fill_shard(linear, slice(start, start + count), tensor,
                               _scale_of(name, linear, where), name)
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


def _scale_of(name: str, linear, where: dict[str, Path]) -> torch.Tensor | None:
    """The scale tensor stored beside an FP8 weight (None if the layer is not FP8 or the
    checkpoint has none)."""
    scheme = getattr(linear, "fp8_scheme", None)
    if scheme is None or not scheme.from_checkpoint:
        return None
    scale_name = name.removesuffix("weight") + scheme.scale_name
    file = where.get(scale_name)
    if file is None:
        return None
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(scale_name)


def _shard_sizes(model: Qwen3ForCausalLM, param_name: str) -> tuple[int, ...] | None:
    module = model.get_submodule(param_name.rsplit(".", 2)[0])
    return getattr(module, "shard_sizes", None) if param_name.endswith(
        ("qkv_proj.weight", "gate_up_proj.weight")) else None


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"model: tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def load_tokenizer(source: ModelSource):
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(source.path))
