"""The offline API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

PROGRESS_MIN_PROMPTS = 8


class LLM:
    """Batch generation on one engine.

    ``LLM("tiny")``, ``LLM("dummy:Qwen3-8B", device="cuda")`` or ``LLM("/path/to/Qwen3-0.6B")``;
    any :class:`~engine.config.EngineConfig` field can be passed as a keyword.
    """

    def __init__(self, model: str = "tiny", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves no request behind.
        token_ids = [self.engine.tokenize(p) for p in prompts]
        ids = [self.engine.add_request(t, p) for t, p in zip(token_ids, params)]
        if use_tqdm is None:
            use_tqdm = self.engine.config.show_progress and len(prompts) >= PROGRESS_MIN_PROMPTS
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
