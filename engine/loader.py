"""Model specs → a Qwen3 model on its device, plus the tokenizer when the model has one.

Specs: a path to an HF folder; ``dummy:Qwen3-<size>`` (random weights, real config); ``tiny``
(a small random checkpoint with a trained tokenizer, generated once, see ``engine.tiny``).
The model is built on the meta device, materialised on the target device, filled from
safetensors (cast to the target dtype on load), and its RoPE cache is built afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import ModelConfig
from engine.models.qwen3 import PACKED_MODULES, Qwen3ForCausalLM

DUMMY_PREFIX = "dummy:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    config: ModelConfig
    path: Path | None  # None for dummy models

    @property
    def model_id(self) -> str:
        """A name that is the same wherever the model's folder sits."""
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
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {spec!r} is not 'tiny', 'dummy:Qwen3-<size>' or a folder "
                         "holding config.json")
    return ModelSource(spec, ModelConfig.from_file(path / "config.json"), path)


def load_model(source: ModelSource, device: torch.device, dtype: torch.dtype,
               seed: int = 0, progress: bool = False) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(source.config)
    model = model.to(dtype).to_empty(device=device)
    if source.is_dummy:
        _init_random(model, seed)
    else:
        load_weights(model, source.path, progress)
    model.model.rope.build(device)
    return model.eval().requires_grad_(False)


def _init_random(model: Qwen3ForCausalLM, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
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


def load_weights(model: Qwen3ForCausalLM, path: Path, progress: bool = False) -> None:
    params = dict(model.named_parameters())
    expected = {n for n in params}
    filled: dict[str, set[int | None]] = {}
    unexpected: list[str] = []
    files = _checkpoint_files(path)
    for file in tqdm(files, desc="loading safetensors shards", unit="shard",
                     disable=not progress, leave=False):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied checkpoints may still store the head
                ours, shard = _target(name)
                param = params.get(ours)
                if param is None:
                    unexpected.append(name)
                    continue
                _copy_shard(param, f.get_tensor(name), shard, _shard_sizes(model, ours), name)
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


def _shard_sizes(model: Qwen3ForCausalLM, param_name: str) -> tuple[int, ...] | None:
    module = model.get_submodule(param_name.rsplit(".", 2)[0])
    return getattr(module, "shard_sizes", None) if param_name.endswith(
        ("qkv_proj.weight", "gate_up_proj.weight")) else None


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int | None,
                sizes: tuple[int, ...] | None, name: str) -> None:
    if shard is None:
        target = param.data
    else:
        offset = sum(sizes[:shard])
        target = param.data.narrow(0, offset, sizes[shard])
    if target.shape != tensor.shape:
        raise ValueError(f"model: tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(tensor)


def load_tokenizer(source: ModelSource):
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(source.path))
