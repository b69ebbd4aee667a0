"""Baton's engine core: Qwen3 over a paged KV cache with prefix caching and continuous batching.

``from engine import LLM, SamplingParams``. Names load on first use (PEP 562), so a process that
needs only the engine's light types (the ingress: sampling parameters, model sources) does not
import torch or the kernels.
"""

from importlib import import_module

_WHERE = {"LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "KVCacheSpec": "engine.kv_layout",
          "KVLayout": "engine.kv_layout",
          "EngineConfig": "engine.config", "Completion": "engine.outputs",
          "OutputCollector": "engine.outputs", "RequestOutput": "engine.outputs",
          "SamplingParams": "engine.sampling_params"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
