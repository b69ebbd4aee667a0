"""Requests in (vLLM v1's input processing): a prompt, text or token ids, and its sampling
parameters become a checked :class:`~engine.sequence.Sequence`.

Tokenizing, the checks the ingress shares (:mod:`engine.validation`), what only the engine can
check (the prompt against its KV blocks, a grammar compiled for its tokenizer), and the grammar
matcher of a structured output. Nothing here touches the scheduler or the device.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence as Seq

from engine.errors import BadRequest
from engine.model_source import ModelSource, load_tokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured import Grammars
from engine.validation import RequestChecks

Prompt = str | Seq[int]


class InputProcessor:
    def __init__(self, source: ModelSource, max_model_len: int, block_size: int):
        self.source = source
        self.block_size = block_size
        self.tokenizer = load_tokenizer(source)
        self.eos_token_ids = eos_token_ids(source, self.tokenizer)
        self.checks = RequestChecks(source.name, self.vocab_size, max_model_len,
                                    self.tokenizer is not None)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.source.config.vocab_size

    @property
    def grammars(self) -> Grammars:
        """The model's structured-output compiler (made at the first request that needs it, by
        whichever thread asks first)."""
        if self.tokenizer is None:
            raise BadRequest(f"structured output: model {self.source.name!r} has no tokenizer")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def tokenize(self, prompt: Prompt, usable_blocks: int) -> list[int]:
        if isinstance(prompt, str):
            self.checks.text()
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        self.validate_prompt(ids, usable_blocks)
        return ids

    def validate_prompt(self, ids: list[int], usable_blocks: int) -> None:
        self.checks.prompt(ids)
        blocks = -(-(len(ids) + 1) // self.block_size)
        if blocks > usable_blocks:
            raise BadRequest(f"prompt: {len(ids)} tokens need {blocks} KV blocks; the cache has "
                             f"{usable_blocks}")

    def compile_grammar(self, so) -> None:
        """Compile a structured output into the cache (any thread: the compiler and its cache
        are thread-safe; a bad spec raises ``BadRequest``)."""
        self.grammars.compile(so)

    def validate_params(self, params: SamplingParams) -> None:
        """The shared checks, and a structured output compiles for the tokenizer (cached by
        spec)."""
        self.checks.params(params)
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)  # a bad spec: BadRequest

    def sequence(self, prompt: Prompt, params: SamplingParams | None, request_id: str,
                 usable_blocks: int) -> Sequence:
        """A checked sequence of one request (with its grammar's matcher); its generator is
        the engine's to give."""
        params = params or SamplingParams()
        if params.num_sequences > 1:
            raise BadRequest(f"n/best_of: an engine request is one sequence, got "
                             f"{params.num_sequences}; fan it out (engine.sampling_params.fan_out)")
        self.validate_params(params)
        ids = self.tokenize(prompt, usable_blocks)
        seq = Sequence(request_id, ids, params)
        if params.structured_output is not None:
            k = params.num_resumed_tokens
            seq.matcher = self.grammars.matcher(params.structured_output, ids[len(ids) - k:] if k
                                                else ())
        return seq


def eos_token_ids(source: ModelSource, tokenizer) -> frozenset[int]:
    """The model's end-of-sequence ids: its config's, its tokenizer's and its generation
    config's."""
    ids = set(source.config.eos_token_id)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_cfg = source.path / "generation_config.json" if source.path else None
    if gen_cfg is not None and gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
