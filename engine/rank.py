"""One rank of an engine: its slice of the model and its runner, built the same way on every rank
(rank 0 in the engine's process, ranks 1..N-1 in :mod:`engine.tp_ranks`'s processes)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import EngineConfig, parse_dtype
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.model_source import ModelSource, resolve_model
from engine.parallel import TPGroup, building


class EngineShape(NamedTuple):
    source: ModelSource
    dtype: torch.dtype
    max_model_len: int


def engine_shape(config: EngineConfig, device: torch.device) -> EngineShape:
    """What an engine (and each of its ranks) runs: the model, the compute dtype (the
    checkpoint's on CUDA, float32 on CPU, unless set) and the context length."""
    source = resolve_model(config.model)
    mcfg = source.config
    if config.dtype is not None:
        dtype = parse_dtype(config.dtype)
    else:
        dtype = parse_dtype(mcfg.torch_dtype) if device.type == "cuda" else torch.float32
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                        mcfg.max_position_embeddings)
    return EngineShape(source, dtype, max_model_len)


def build_rank(config: EngineConfig, device: torch.device, group: TPGroup,
               progress: bool = False) -> ModelRunner:
    """``group``'s rank of the model on ``device`` (its slice of the weights, its KV heads) and
    the runner that owns it and its KV cache (``config.num_blocks`` blocks, or as many as the
    device's share holds)."""
    shape = engine_shape(config, device)
    with building(group):
        model = load_model(shape.source, device, shape.dtype, seed=config.seed,
                           progress=progress, quantization=config.quantization)
        return ModelRunner(model, config, device, shape.dtype, shape.max_model_len)
