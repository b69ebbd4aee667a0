"""The GPU engine against its references (run on a GPU host: ``make test-gpu``).

- FlashInfer attention vs the torch backend, both in bf16: every step of a run is computed twice
  on the same inputs and the same cache (first through the torch backend, eager; then as the
  engine runs it, FlashInfer and CUDA graphs), and the logits agree within 1e-2 relative error:
  prefill, prefill behind a cached prefix, chunked prefill, decode at several batch sizes.
- CUDA-graph decode vs eager: identical greedy tokens.
- Greedy tokens identical to transformers in float32 on a Qwen3-0.6B-shaped model, 64 tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.models import random_prompts

pytestmark = pytest.mark.gpu
MODEL = "dummy:Qwen3-0.6B"
VOCAB = 151936


def _engine(**kw) -> LLMEngine:
    cfg = dict(model=MODEL, device="cuda", dtype="bfloat16", num_blocks=1024,
               max_num_seqs=64, show_progress=False, seed=0)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def _run(engine: LLMEngine, prompts, max_tokens: int, prefix: str = "r") -> dict:
    """Greedy-generate; return {request id: tokens}."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"{prefix}{i}") for i, p in enumerate(prompts)]
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return {i: tokens[i] for i in ids}


class TwoBackends:
    """Runs every step through the torch backend first (eager), then as configured; keeps
    (kind of step, torch logits, engine logits) per step."""

    def __init__(self, engine: LLMEngine):
        runner = self.runner = engine.runner
        cfg = engine.model.config
        self.torch = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads,
                                           cfg.head_dim, cfg.head_dim ** -0.5, runner.block_size)
        self.steps = []
        self.execute = runner.execute
        runner.execute = self._both

    def _both(self, batch):
        runner, layers = self.runner, self.runner.model.attention_layers()
        graphs, backend = runner.graphs, runner.backend
        runner.graphs, runner.backend = None, self.torch
        for attn in layers:
            attn.backend = self.torch
        try:
            ref = self.execute(batch)
        finally:
            runner.graphs, runner.backend = graphs, backend
            for attn in layers:
                attn.backend = backend
        out = self.execute(batch)
        kind = "decode" if all(n == 1 for n in batch.num_new_tokens) else "prefill"
        if out is not None:
            # A graph's logits live in a static buffer that the next replay overwrites.
            self.steps.append((kind, len(batch.seqs), ref.float(), out.float().clone()))
        return out

    def check(self, kinds=("prefill", "decode")) -> None:
        assert {k for k, *_ in self.steps} >= set(kinds)
        for kind, n, ref, out in self.steps:
            err = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
            print(f"{kind} step, {n} sequences: logits relative error {err:.2e}")
            assert err < 1e-2, f"{kind} step of {n} sequences: relative error {err:.3g}"
        self.runner.execute = self.execute


@pytest.fixture(scope="module")
def flashinfer_engine():
    pytest.importorskip("flashinfer")
    return _engine(attention_backend="flashinfer")


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_flashinfer_matches_torch_prefill_and_decode(flashinfer_engine, batch):
    both = TwoBackends(flashinfer_engine)
    _run(flashinfer_engine, random_prompts([5 + 37 * i for i in range(batch)], vocab=VOCAB,
                                           seed=batch), 8, prefix=f"b{batch}-")
    both.check()


def test_flashinfer_matches_torch_behind_cached_prefix(flashinfer_engine):
    base = random_prompts([80, 150], vocab=VOCAB, seed=7)
    ext = [p + q for p, q in zip(base, random_prompts([9, 40], vocab=VOCAB, seed=8))]
    _run(flashinfer_engine, base, 1, prefix="warm")
    hits = flashinfer_engine.pool.hit_tokens
    both = TwoBackends(flashinfer_engine)
    _run(flashinfer_engine, ext, 4, prefix="hit")
    assert flashinfer_engine.pool.hit_tokens >= hits + 80 + 144  # whole blocks of both prefixes
    both.check()


def test_flashinfer_matches_torch_chunked_prefill():
    pytest.importorskip("flashinfer")
    chunked = _engine(attention_backend="flashinfer", max_num_batched_tokens=64)
    both = TwoBackends(chunked)
    _run(chunked, random_prompts([300, 190], vocab=VOCAB, seed=9), 4, prefix="c")
    assert sum(k == "prefill" for k, *_ in both.steps) >= 1
    both.check()


def test_cuda_graph_decode_matches_eager_tokens(flashinfer_engine):
    assert flashinfer_engine.runner.graphs is not None
    eager = _engine(attention_backend="flashinfer", enforce_eager=True)  # same seed, weights
    for n in (1, 3, 8):
        prompts = random_prompts([20 + 11 * i for i in range(n)], vocab=VOCAB, seed=n)
        graph_tokens = _run(flashinfer_engine, prompts, 32, prefix=f"g{n}-")
        eager_tokens = _run(eager, prompts, 32, prefix=f"g{n}-")
        assert graph_tokens == eager_tokens


def test_greedy_tokens_match_transformers_qwen3_06b_float32():
    from engine.loader import resolve_model
    from engine.tiny import write_random_qwen3
    from tests.models import hf_greedy

    shape = resolve_model(MODEL).config  # the real 0.6B shape, random weights from transformers
    folder = Path(os.environ["BATON_CACHE"]) / "test-qwen3-0.6b-shape"
    if not (folder / "config.json").is_file():
        write_random_qwen3(folder, dict(
            hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim),
            vocab_size=shape.vocab_size, tie_word_embeddings=True, initializer_range=0.1, seed=3)
    prompts = random_prompts([17, 64], vocab=VOCAB, seed=11)
    torch.backends.cuda.matmul.allow_tf32 = False
    _, reference = hf_greedy(folder, prompts, 64, device="cuda")
    engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32",
                                    num_blocks=256, show_progress=False))
    tokens = _run(engine, prompts, 64)
    assert list(tokens.values()) == [hf_tokens for hf_tokens, _ in reference]
