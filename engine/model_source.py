"""Model specs and where a model's files are: a folder; a Hugging Face repo id found in the local
cache (read only: nothing is ever downloaded); ``dummy:Qwen3-<size>`` (random weights, real
config); ``tiny``. Also the tokenizer. Light to import (no torch): the ingress uses it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from engine.config import ModelConfig

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


def load_tokenizer(source: ModelSource):
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(source.path))
