"""Baton's engine core: Qwen3 over a paged KV cache with prefix caching and continuous batching.

``from engine import LLM, SamplingParams``.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import KVCacheSpec, LLMEngine
from engine.outputs import Completion, OutputCollector, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "Completion", "EngineConfig", "KVCacheSpec", "OutputCollector",
           "RequestOutput", "SamplingParams"]
