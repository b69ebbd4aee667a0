"""The offline API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.errors import BadRequest
from engine.generation_config import log_defaults, sampling_defaults
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import Completion, OutputCollector
from engine.sampling_params import SamplingParams, best_indices, fan_out

PROGRESS_MIN_PROMPTS = 8


class LLM:
    """Batch generation on one engine.

    ``LLM("tiny")``, ``LLM("dummy:Qwen3-8B", device="cuda")`` or ``LLM("/path/to/Qwen3-0.6B")``;
    any :class:`~engine.config.EngineConfig` field can be passed as a keyword.
    """

    def __init__(self, model: str = "tiny", **kwargs):
        config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self._defaults = sampling_defaults(self.engine.source.path, config.generation_config,
                                           config.override_generation_config)
        log_defaults(self._defaults, "LLM")

    def get_default_sampling_params(self) -> SamplingParams:
        """What :meth:`generate` samples with when given no parameters (vLLM's): the model's
        generation config (``EngineConfig.generation_config``) over :class:`SamplingParams`'
        defaults; its ``max_new_tokens`` is the ``max_tokens``."""
        return SamplingParams(**self._defaults)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[Completion | list[Completion]]:
        """One :class:`Completion` per prompt, or for a prompt whose parameters ask for several
        sequences (``n``, ``best_of``) the list of its ``n`` completions (with ``best_of``, the
        ``n`` of highest cumulative logprob, best first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise BadRequest(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves no request behind.
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for p in params:
            self.engine.validate_params(p)
        # A request of n (or best_of) sequences runs as that many engine requests; they share
        # the prompt's KV through the prefix cache (the scheduler holds back a sequence whose
        # prompt blocks another one is computing), so the prompt is prefilled once.
        collectors: dict[str, OutputCollector] = {}
        groups: list[tuple[SamplingParams, list[str]]] = []
        for ids, p in zip(token_ids, params):
            rids = []
            for child in fan_out(p):
                rid = self.engine.add_request(ids, child)
                collectors[rid] = OutputCollector(rid, ids, child, self.tokenizer)
                rids.append(rid)
            groups.append((p, rids))
        if use_tqdm is None:
            use_tqdm = self.engine.config.show_progress and len(prompts) >= PROGRESS_MIN_PROMPTS
        self._run(collectors, use_tqdm)
        results = []
        for p, rids in groups:
            done = [collectors[rid].result for rid in rids]
            if p.num_sequences == 1:
                results.append(done[0])
            else:
                results.append([done[i] for i in best_indices(
                    p, [c.cumulative_logprob or 0.0 for c in done])])
        return results

    def _run(self, collectors: dict[str, OutputCollector], progress: bool) -> None:
        """Step the engine until every request has ended, folding its outputs in."""
        with tqdm(total=len(collectors), desc="generate", disable=not progress, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    collector = collectors[out.request_id]
                    if collector.result.finished:
                        continue
                    if collector.add(out):
                        if not out.finished:  # a stop string: the engine stops on ids only
                            self.engine.abort_request(out.request_id)
                        bar.update(1)
