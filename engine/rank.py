"""One rank of an engine: its slice of the model and its runner, built the same way on every rank
(rank 0 in the engine's process, ranks 1..N-1 in :mod:`engine.tp_ranks`'s processes)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import EngineConfig, parse_dtype
from engine.loader import load_model
from engine.model_runner import ModelRunner, block_bytes, kv_cache_dtype
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
               progress: bool = False, extra_block_bytes: int = 0) -> ModelRunner:
    """``group``'s rank of the model on ``device`` (its slice of the weights, its KV heads) and
    the runner that owns it and its KV cache (``config.num_blocks`` blocks, or as many as the
    device's share holds, less ``extra_block_bytes`` a block for another cache)."""
    shape = engine_shape(config, device)
    with building(group):
        model = load_model(shape.source, device, shape.dtype, seed=config.seed,
                           progress=progress, quantization=config.quantization)
        return ModelRunner(model, config, device, shape.dtype, shape.max_model_len,
                           extra_block_bytes)


def build_draft(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                target: ModelSource, progress: bool = False):
    """The draft model of ``config.speculative_config`` (method ``draft_model``), whole on
    ``device`` in the target's compute dtype (its weights quantized as the config's
    ``quantization`` says), and what its KV costs a block; its runner comes once the target's
    blocks are sized (:func:`draft_runner`)."""
    spec = config.speculative_config
    source = resolve_model(spec.model)
    mcfg, tcfg = source.config, target.config
    if mcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"speculative_config: the draft {source.name} has a vocabulary of "
                         f"{mcfg.vocab_size}, the target {tcfg.vocab_size}; they must match")
    with building(TPGroup()):
        model = load_model(source, device, dtype, seed=config.seed, progress=progress,
                           quantization=spec.quantization)
    return model, block_bytes(mcfg, mcfg.num_key_value_heads, config.block_size,
                              kv_cache_dtype(config.kv_cache_dtype, dtype))


def draft_runner(config: EngineConfig, model, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, num_blocks: int) -> ModelRunner:
    """The draft's runner: its own cache of the target's ``num_blocks`` blocks (the target's
    block tables index it), its own CUDA graphs."""
    if model.config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config: the draft's context "
                         f"({model.config.max_position_embeddings}) is shorter than the "
                         f"target's max_model_len ({max_model_len})")
    spec = config.speculative_config
    draft = config.model_copy(update={
        "model": spec.model, "num_blocks": num_blocks, "quantization": spec.quantization,
        "fp8_lm_head": config.fp8_lm_head if spec.fp8_lm_head is None else spec.fp8_lm_head,
        "speculative_config": None, "kv_offloading_size": 0.0, "tensor_parallel_size": 1})
    with building(TPGroup()):
        runner = ModelRunner(model, draft, device, dtype, max_model_len, samples=False)
    runner.rows_for_all = True  # its first step's two tokens (engine.draft_model) as rows
    return runner
