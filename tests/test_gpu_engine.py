"""The GPU engine against its references (run on a GPU host: ``make test-gpu``).

- FlashInfer attention vs the torch backend, both in bf16, on the same inputs and cache
  (:class:`TwoBackends`): attention outputs of every layer within 1e-2, logits of every step
  within 2e-2; for prefill, prefill behind a cached prefix, chunked prefill, and decode at
  several batch sizes.
- CUDA-graph decode and piecewise mixed-step graphs vs eager: identical greedy tokens; with
  penalties, bias, min_tokens, min_p and top logprobs too (engine one step ahead vs eager step
  by step).
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
from tests.test_mixed_graphs import staggered

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
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


class TwoBackends:
    """Checks FlashInfer against the torch backend (both bf16) on a running engine, two ways.

    Per layer: every attention call runs both backends on the same query and cache, and their
    outputs must agree within 1e-2 (the backend's own error; expected ~1e-3). This runs eager.
    Per step: the whole step runs through the torch backend first, then as the engine runs it
    (FlashInfer, CUDA graphs), on the same inputs and cache, and the logits must agree within
    2e-2. The logits bound is wider than the per-layer one because this model's random weights
    amplify bf16 rounding over 28 layers: the engine's bf16 logits differ from a float32 run of
    the same weights by ~1.3% whichever attention backend it uses.
    """

    LAYER_TOL, LOGITS_TOL = 1e-2, 2e-2

    def __init__(self, engine: LLMEngine, per_layer: bool):
        runner = self.runner = engine.runner
        cfg = engine.model.config
        self.torch = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads,
                                           cfg.head_dim, cfg.head_dim ** -0.5, runner.block_size)
        self.flashinfer, self.per_layer = runner.backend, per_layer
        self.graphs = (runner.graphs, runner.mixed)
        self.steps, self.layers = [], []
        self.execute = runner.execute
        if per_layer:
            self._use(self, graphs=(None, None))
        else:
            runner.execute = self._both

    # -- per layer: this object stands in for the backend ----------------------------------
    def plan(self, meta):
        self.torch.plan(meta)
        self.flashinfer.plan(meta)

    def forward(self, q, kv_cache, meta, k_scale=1.0, v_scale=1.0, out=None):
        out = self.flashinfer.forward(q, kv_cache, meta, k_scale, v_scale, out=out)
        ref = self.torch.forward(q, kv_cache, meta, k_scale, v_scale)
        self.layers.append(("decode" if meta.is_decode_only else "prefill", meta.num_seqs,
                            ((out.float() - ref.float()).norm() / ref.float().norm()).item()))
        return out

    # -- per step ---------------------------------------------------------------------------
    def _use(self, backend, graphs):
        self.runner.backend = backend
        self.runner.graphs, self.runner.mixed = graphs
        for attn in self.runner.model.attention_layers():
            attn.backend = backend

    def _both(self, batch, prev_tokens=None, draws=None):
        self._use(self.torch, (None, None))
        try:
            ref = self.execute(batch, prev_tokens)
        finally:
            self._use(self.flashinfer, self.graphs)
        out = self.execute(batch, prev_tokens, draws)
        kind = "decode" if all(n == 1 for n in batch.num_new_tokens) else "prefill"
        if out is not None:
            err = ((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max()
            self.steps.append((kind, len(batch.seqs), err.item()))
        return out

    def restore(self) -> None:
        self.runner.execute = self.execute
        self._use(self.flashinfer, self.graphs)

    def check(self) -> None:
        records, tol = (self.layers, self.LAYER_TOL) if self.per_layer else (self.steps,
                                                                              self.LOGITS_TOL)
        assert {k for k, *_ in records} == {"prefill", "decode"}
        for kind in ("prefill", "decode"):
            worst = max(e for k, _, e in records if k == kind)
            what = "attention output" if self.per_layer else "logits"
            print(f"{kind}: worst {what} relative error {worst:.2e}")
            assert worst < tol, f"{kind}: {what} relative error {worst:.3g}"


@pytest.fixture(scope="module")
def flashinfer_engine():
    pytest.importorskip("flashinfer")
    return _engine(attention_backend="flashinfer")


PER = pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "logits"])


@PER
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_flashinfer_matches_torch_prefill_and_decode(flashinfer_engine, batch, per_layer):
    both = TwoBackends(flashinfer_engine, per_layer)
    try:
        _run(flashinfer_engine, random_prompts([5 + 37 * i for i in range(batch)], vocab=VOCAB,
                                               seed=batch), 8, prefix=f"b{batch}{per_layer}-")
    finally:
        both.restore()
    both.check()


@PER
def test_flashinfer_matches_torch_behind_cached_prefix(flashinfer_engine, per_layer):
    base = random_prompts([80, 150], vocab=VOCAB, seed=7)
    ext = [p + q for p, q in zip(base, random_prompts([9, 40], vocab=VOCAB, seed=8))]
    _run(flashinfer_engine, base, 1, prefix=f"warm{per_layer}")
    hits = flashinfer_engine.pool.hit_tokens
    both = TwoBackends(flashinfer_engine, per_layer)
    try:
        _run(flashinfer_engine, ext, 4, prefix=f"hit{per_layer}")
    finally:
        both.restore()
    assert flashinfer_engine.pool.hit_tokens >= hits + 80 + 144  # whole blocks of both prefixes
    both.check()


@PER
def test_flashinfer_matches_torch_chunked_prefill(per_layer):
    pytest.importorskip("flashinfer")
    chunked = _engine(attention_backend="flashinfer", max_num_batched_tokens=64)
    both = TwoBackends(chunked, per_layer)
    try:
        _run(chunked, random_prompts([300, 190], vocab=VOCAB, seed=9), 4, prefix="c")
    finally:
        both.restore()
    both.check()


def test_cuda_graph_decode_matches_eager_tokens(flashinfer_engine):
    assert flashinfer_engine.runner.graphs is not None
    assert set(flashinfer_engine.runner.gemv_choices) == {"qkv_proj", "o_proj", "gate_up_proj",
                                                          "down_proj", "lm_head"}
    eager = _engine(attention_backend="flashinfer", enforce_eager=True)  # same seed, weights
    for n in (1, 3, 8):
        prompts = random_prompts([20 + 11 * i for i in range(n)], vocab=VOCAB, seed=n)
        graph_tokens = _run(flashinfer_engine, prompts, 32, prefix=f"g{n}-")
        eager_tokens = _run(eager, prompts, 32, prefix=f"g{n}-")
        assert graph_tokens == eager_tokens


class _Counting:
    """A captured graph standing in for itself that notes ``key`` in ``replays`` at each replay."""

    def __init__(self, graph, key, replays: list):
        self.graph, self.key, self.replays = graph, key, replays

    def replay(self):
        self.replays.append(self.key)
        self.graph.replay()


def test_greedy_steps_argmax_in_their_graph_gives_the_tokens_sampled_apart(flashinfer_engine):
    """A step whose every sequence is plain greedy replays its size's greedy graph (the pending
    ids' gather and the argmax inside it, ``ARGMAX_MAX_ROWS``; the step's inputs read from and its
    ids written to pinned memory by the graph itself): requests joining and leaving
    (plain greedy, a penalty that reads the newest token from the graph's buffer, a seeded
    sampled one with logprobs, a stop id) give the same tokens as the same engine with those
    graphs set aside, which samples every step apart; both graph kinds were replayed."""
    from engine.cuda_graph import ARGMAX_MAX_ROWS
    from tests.test_async_scheduling import _staggered_mixed
    graphs = flashinfer_engine.runner.graphs
    assert {k[0] for k in graphs.draw_graphs} == {s for s in graphs.sizes
                                                  if s <= ARGMAX_MAX_ROWS}
    # Baton's decode kernel's sizes: one graph a pinned buffer, reading it itself
    assert {(1, False, 0), (1, False, 1), (8, False, 0), (8, False, 1)} <= set(
        graphs.draw_graphs)
    saved, replays = dict(graphs.draw_graphs), []
    graphs.draw_graphs.update({k: _Counting(g, k, replays) for k, g in saved.items()})
    try:
        flashinfer_engine.reset_prefix_cache()
        fused = _staggered_mixed(flashinfer_engine, "fused")
        greedy_replays = len(replays)
        graphs.draw_graphs.clear()
        flashinfer_engine.reset_prefix_cache()
        apart = _staggered_mixed(flashinfer_engine, "apart")
    finally:
        graphs.draw_graphs.clear()
        graphs.draw_graphs.update(saved)
    assert fused == apart
    assert greedy_replays > 10 and len(replays) == greedy_replays
    assert {k[2] for k in replays} == {0, 1}  # both pinned buffers, read by the graphs
    assert flashinfer_engine.pool.num_used_blocks == 0


def test_sampled_steps_draw_in_their_graph(flashinfer_engine):
    """Steps whose rows are sampled at a temperature, or cut to a top-k and top-p (Qwen3's
    recommended 0.6, 20, 0.95), with nothing else asked replay the draw graphs (Philox in the
    argmax kernel, ``kernels.argmax``) beside greedy rows: every request runs to its length
    with in-vocabulary ids, requests of one prompt part ways, a greedy request among them
    gives the tokens it gives when the same batch samples apart (its rows' numbers do not
    depend on the others'), and a greedy request alone after them, in the row a sampled one
    held, the tokens of one alone before."""
    graphs = flashinfer_engine.runner.graphs
    saved, replays = dict(graphs.draw_graphs), []
    graphs.draw_graphs.update({k: _Counting(g, k, replays) for k, g in saved.items()})
    prompt = random_prompts([24], vocab=VOCAB, seed=11)[0]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    mix = [SamplingParams(temperature=1.0 if i < 2 else 0.6, top_k=-1 if i < 2 else 20,
                          top_p=1.0 if i < 2 else 0.95, max_tokens=20 + i, ignore_eos=True)
           for i in range(4)] + [greedy]

    def run(params: list[SamplingParams], tag: str) -> list[list[int]]:
        flashinfer_engine.reset_prefix_cache()
        got = {flashinfer_engine.add_request(prompt, p, request_id=f"{tag}{i}"): []
               for i, p in enumerate(params)}
        while flashinfer_engine.has_unfinished_requests():
            for out in flashinfer_engine.step():
                got[out.request_id] += out.new_token_ids
        return list(got.values())
    try:
        alone = run([greedy], "alone")
        replays.clear()
        mixed = run(mix, "mixed")
        sampled_replays = len(replays)
        after = run([greedy], "after")
        graphs.draw_graphs.clear()
        apart = run(mix, "apart")
    finally:
        graphs.draw_graphs.clear()
        graphs.draw_graphs.update(saved)
    assert sampled_replays > 15
    assert [len(t) for t in mixed] == [20, 21, 22, 23, 20]
    vocab = flashinfer_engine.runner.model.config.vocab_size
    assert all(0 <= t < vocab for tokens in mixed for t in tokens)
    assert len({tuple(t[1:20]) for t in mixed[:4]}) == 4
    assert mixed[4] == apart[4]
    assert after == alone
    assert flashinfer_engine.pool.num_used_blocks == 0


def test_long_decode_steps_replay_their_own_graph_and_match_eager(flashinfer_engine):
    """Decode steps past ``SMALL_DECODE_MAX_CONTEXT`` tokens run FlashInfer's attention (a
    second graph of the size; eager steps plan the same): prompts that cross the limit while
    decoding, one and three at a time, give the eager engine's tokens and logprobs up to any
    near-tie (FlashInfer splits a long row's KV differently under a graph than in an eager
    plan, so the sums round differently), and the long graphs were replayed."""
    from engine.attention.flashinfer_backend import SMALL_DECODE_MAX_CONTEXT
    graphs = flashinfer_engine.runner.graphs
    assert set(graphs.long_graphs) == {s for s in graphs.sizes if s <= 8}
    replays, saved = [], dict(graphs.long_graphs)
    graphs.long_graphs.update({s: _Counting(g, s, replays) for s, g in saved.items()})
    eager = _engine(attention_backend="flashinfer", enforce_eager=True)
    try:
        for n in (1, 3):
            prompts = random_prompts([SMALL_DECODE_MAX_CONTEXT - 10 - i for i in range(n)],
                                     vocab=VOCAB, seed=n)
            graphed = staggered(flashinfer_engine, prompts, max_tokens=24, every=1)
            ref = staggered(eager, prompts, max_tokens=24, every=1)
            assert graphed.keys() == ref.keys()
            for rid, (tokens, logprobs, _) in ref.items():
                _same_greedy_up_to_a_tie(graphed[rid][0], graphed[rid][1], tokens, logprobs,
                                         rid)
    finally:
        graphs.long_graphs.update(saved)
    assert 1 in replays and 4 in replays


def test_piecewise_graphs_of_mixed_steps_replay_what_the_pieces_compute():
    """Prompts that join a decoding batch (one every 3 steps; one of 400 tokens, padded to 448
    rows, one of 1,100, padded to 1,152, with graphs to 2,048 tokens) and one behind a cached
    prefix. Against the same pieces run as plain calls (same
    shapes; cuBLAS may pick another kernel under capture: a first token's logprob moved by
    0.016) and against the eager engine (whose matmuls see the unpadded row count): the same
    tokens and logprobs within 0.05 up to any near-tie, where the two picks' logprobs are within
    0.05 too (this random model's next-token distribution is nearly flat, top logprobs near -9:
    requests took another token at their first or sixth step). That padding never touches a real
    row is checked exactly in float32 on the CPU: tests/test_mixed_graphs.py."""
    pytest.importorskip("flashinfer")
    engine = _engine(attention_backend="flashinfer", cuda_graph_max_tokens=2048)
    runner = engine.runner
    mixed = runner.mixed
    assert mixed is not None and set(mixed.graphs) == set(mixed.sizes)
    calls, run = [], mixed.run

    def counting(step, prev=None):
        calls.append(len(step.ids))
        return run(step, prev)
    shared = random_prompts([100], vocab=VOCAB, seed=21)[0]
    prompts = random_prompts([30, 5, 70, 17, 400, 9, 1100], vocab=VOCAB, seed=22)
    prompts += [shared + [1, 2], shared + [3]]
    mixed.run = counting
    graphed = staggered(engine, prompts, max_tokens=24)
    mixed.use_graphs = False
    pieces = staggered(engine, prompts, max_tokens=24)
    assert len(calls) >= len(prompts) and max(calls) > 1100  # both runs, 448 and 1152 rows
    eager = staggered(_engine(attention_backend="flashinfer", enforce_eager=True), prompts,
                      max_tokens=24)
    for ref in (pieces, eager):
        assert graphed.keys() == ref.keys()
        for rid, (tokens, logprobs, _) in ref.items():
            _same_greedy_up_to_a_tie(graphed[rid][0], graphed[rid][1], tokens, logprobs, rid)


@pytest.mark.parametrize("kv_cache_dtype,prompt_max", [("auto", 512), ("fp8", 512),
                                                       ("auto", 1024)])
def test_lone_prompt_graphs_replay_what_their_plain_calls_compute(kv_cache_dtype, prompt_max):
    """Prompts one at a time, each alone in its step with nothing cached before it: each step
    replays the one graph of its size, attention included (planned once at capture; 5 tokens
    padded to 16, 128 exactly, 400 padded to 448, 512, 102 padded to 112); a prompt behind a
    cached prefix takes the pieces, and a 600-token one runs eagerly or, with lone-prompt
    graphs to 1,024 tokens (beyond the pieces' 512), replays its own padded to 640. Against the
    same whole step run as plain calls (the eager prefill wrapper over the same padded shape)
    and against the eager engine: the same tokens and logprobs up to a near-tie, as above; over
    a bf16 and an FP8 cache."""
    pytest.importorskip("flashinfer")
    kw = dict(attention_backend="flashinfer", kv_cache_dtype=kv_cache_dtype,
              cuda_graph_prompt_max_tokens=prompt_max)
    shared = random_prompts([100], vocab=VOCAB, seed=23)[0]
    prompts = random_prompts([5, 128, 400, 512, 600], vocab=VOCAB, seed=24)
    prompts += [shared + [1, 2], shared + [3]]
    runs = []
    for graphs in (True, False):
        engine = _engine(**kw)
        mixed = engine.runner.mixed
        assert mixed is not None and set(mixed.prompt_graphs) == set(mixed.prompt_sizes)
        assert mixed.prompt_sizes[-1] == prompt_max
        mixed.use_graphs = graphs
        calls, run_prompt = [], mixed.run_prompt

        def counting(step, size, mixed=mixed, calls=calls, run_prompt=run_prompt):
            calls.append((len(step.ids), size, mixed.use_graphs and size in mixed.prompt_graphs))
            return run_prompt(step, size)
        mixed.run_prompt = counting
        runs.append(staggered(engine, prompts, max_tokens=16, every=100))
        assert calls == [(5, 16, graphs), (128, 128, graphs), (400, 448, graphs),
                         (512, 512, graphs)] + [(600, 640, graphs)] * (prompt_max > 600) + [
                         (102, 112, graphs)]
    eager = staggered(_engine(**kw, enforce_eager=True), prompts, max_tokens=16, every=100)
    graphed = runs[0]
    for ref in (runs[1], eager):
        assert graphed.keys() == ref.keys()
        for rid, (tokens, logprobs, _) in ref.items():
            _same_greedy_up_to_a_tie(graphed[rid][0], graphed[rid][1], tokens, logprobs, rid)


def _same_greedy_up_to_a_tie(tokens, logprobs, ref_tokens, ref_logprobs, rid, tol=0.05):
    """Greedy runs of one model that round differently: the same tokens with logprobs within
    ``tol``, up to a step where both picks were within ``tol`` of each other (a near-tie, common
    with random weights, whose next-token distribution is nearly flat); after it the texts
    differ, so nothing more is compared."""
    d = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    assert logprobs[:d] == pytest.approx(ref_logprobs[:d], abs=tol), rid
    if d < len(tokens):
        assert abs(logprobs[d] - ref_logprobs[d]) < tol, (rid, d)


def test_cuda_graph_decode_of_a_shared_prompt_beyond_the_cache_block_count():
    """64 sequences of one 512-token prompt list 64 x 33 block indices a step, though the cache
    has 256 blocks (they share the prompt's 32): the graphs' index buffer holds them (it was
    sized by the cache's block count, and FlashInfer refused the plan), and the tokens equal
    the eager engine's."""
    pytest.importorskip("flashinfer")
    kw = dict(attention_backend="flashinfer", num_blocks=256, max_num_seqs=64)
    prompt = random_prompts([512], vocab=VOCAB, seed=11)[0]
    graphs, eager = _engine(**kw), _engine(**kw, enforce_eager=True)
    assert graphs.runner.graphs is not None
    tokens = [_run(engine, [prompt] * 64, 8, prefix="shared") for engine in (graphs, eager)]
    assert tokens[0] == tokens[1]
    assert graphs.pool.hit_tokens >= 63 * 496  # the prompt's blocks computed once


def test_async_scheduling_matches_one_step_at_a_time(flashinfer_engine):
    """The engine one step ahead (CUDA graphs, pending inputs fed on the device, pinned copies
    back) gives the tokens of the engine that waits for every step; a stop on a token cuts
    both at the same place, and nothing leaks. (Every batch has the same rows in both modes, so
    bf16 rounding cannot differ between them.)"""
    assert flashinfer_engine.config.async_scheduling
    sync = _engine(attention_backend="flashinfer", async_scheduling=False)
    prompts = random_prompts([7, 40, 130, 300, 33, 64], vocab=VOCAB, seed=21)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=48, ignore_eos=True)] * 3

    def run(engine, tag, prompts, params):
        ids = [engine.add_request(p, q, request_id=f"{tag}{i}")
               for i, (p, q) in enumerate(zip(prompts, params))]
        tokens, reasons = {i: [] for i in ids}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [(tokens[i], reasons[i]) for i in ids]

    assert run(flashinfer_engine, "ahead", prompts, params) == run(sync, "sync", prompts, params)
    stop_at = run(sync, "probe", prompts[1:2], params[:1])[0][0][5]
    stop = [SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop_at])]
    ahead = run(flashinfer_engine, "stop-ahead", prompts[1:2], stop)
    assert ahead == run(sync, "stop-sync", prompts[1:2], stop)
    assert ahead[0][1] == "stop" and len(ahead[0][0]) <= 6
    assert flashinfer_engine.pool.num_used_blocks == 0 and sync.pool.num_used_blocks == 0


def test_changed_logits_and_top_logprobs_under_cuda_graphs(flashinfer_engine):
    """The sampling paths that change logits (penalties over the token history, with the newest
    token read from the device one step ahead; bias; min_tokens; min_p) and top logprobs, on a
    graphed engine running ahead, give the tokens and logprobs of the eager engine that waits
    for every step; n sequences share their prompt's prefill."""
    eager = _engine(attention_backend="flashinfer", enforce_eager=True, async_scheduling=False)
    prompts = random_prompts([9, 40, 130, 33], vocab=VOCAB, seed=31)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5, logprobs=5),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, min_p=0.05,
                       presence_penalty=1.0, logit_bias={100: 5.0, 7: -100.0}),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]

    def run(engine, tag):
        ids = [engine.add_request(p, q, request_id=f"{tag}{i}")
               for i, (p, q) in enumerate(zip(prompts, params))]
        got = {i: ([], [], []) for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens, lps, tops = got[out.request_id]
                tokens += out.new_token_ids
                lps += out.new_logprobs or []
                tops += [[t for t, _ in top] for top in out.new_top_logprobs or []]
        return [got[i] for i in ids]

    graphed, reference = run(flashinfer_engine, "pen-g"), run(eager, "pen-e")
    for (g_tok, g_lp, g_top), (e_tok, e_lp, e_top) in zip(graphed, reference):
        assert g_tok == e_tok and g_top == e_top
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(e_lp), atol=1e-3,
                                   rtol=1e-3)
    assert len(graphed[2][0]) >= 30 and all(len(t) == 5 for t in graphed[0][2])
    # n = 4 of one 300-token prompt: one prefill, then each other sequence its last 12 tokens.
    prompt = random_prompts([300], vocab=VOCAB, seed=32)[0]
    before = flashinfer_engine.stats.scheduled_tokens
    from engine.sampling_params import fan_out
    for i, child in enumerate(fan_out(SamplingParams(temperature=1.0, seed=1, max_tokens=4,
                                                     ignore_eos=True, n=4))):
        flashinfer_engine.add_request(prompt, child, request_id=f"n{i}")
    while flashinfer_engine.has_unfinished_requests():
        flashinfer_engine.step()
    assert flashinfer_engine.stats.scheduled_tokens - before == 300 + 3 * 12 + 4 * 3
    assert flashinfer_engine.pool.num_used_blocks == 0 and eager.pool.num_used_blocks == 0


def test_structured_output_under_cuda_graphs(tmp_path):
    """A grammar's bitmask applied on the device, with the engine one step ahead and decode in
    CUDA graphs: the tokens of the eager engine that waits for every step, each accepted by the
    grammar. The model: random, with the tiny model's tokenizer (a grammar needs one) and
    FlashInfer's head size (64), bfloat16 (CUDA graphs come with FlashInfer)."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("flashinfer")
    from engine.structured import StructuredOutput
    from engine.tiny import train_tokenizer, write_random_qwen3
    model = write_random_qwen3(tmp_path / "m", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64), tokenizer=train_tokenizer())
    schema = StructuredOutput.schema({"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok", "n"]})
    choice = StructuredOutput.choice(["alpha", "beta", "gamma delta"])
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_output=so)
              for s in range(3) for so in (schema, choice)]
    prompts = ["Tell me about", "x", "hello there"] * 2
    runs = []
    for kw in (dict(), dict(enforce_eager=True, async_scheduling=False)):
        engine = LLMEngine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                                        attention_backend="flashinfer", show_progress=False,
                                        **kw))
        assert (engine.runner.graphs is not None) == (not kw)
        ids = [engine.add_request(p, q, request_id=f"s{i}")
               for i, (p, q) in enumerate(zip(prompts, params))]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        runs.append([tokens[i] for i in ids])
        for toks, q in zip(runs[-1], params):
            m = engine.grammars.matcher(q.structured_output)
            assert all(m.accept_token(t) for t in toks)
        assert engine.pool.num_used_blocks == 0
    assert runs[0] == runs[1]


def test_greedy_tokens_match_transformers_qwen3_06b_float32():
    from engine.model_source import resolve_model
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


@pytest.mark.parametrize("which", ["graph", "eager", "prefill"])
def test_attention_plans_do_not_wait_for_the_running_step(which, monkeypatch):
    """The engine plans a step while the one before it runs: a FlashInfer plan made while the
    device is busy returns without waiting for it. Decode through a graph's wrapper (a changed
    work split, then the same one: page ids alone), through the eager wrapper, and a prompt
    step's plan. (The graph's case failed before the page ids were uploaded first: FlashInfer
    copied host page ids with a blocking copy, 0.51 s for half a second of device work.)"""
    import time

    from engine.attention.flashinfer_backend import FlashInferBackend
    from engine.forward_context import null_meta

    dev, rows = torch.device("cuda"), 64
    monkeypatch.setenv("BATON_SMALL_DECODE", "few")  # FlashInfer's graph wrapper at 64 rows
    backend = FlashInferBackend(16, 8, 128, 128 ** -0.5, 16, dev, torch.bfloat16)

    def decode(pages: int):
        meta = null_meta(rows, 1, 16)
        meta.kv_indptr = torch.arange(0, rows * pages + 1, pages, dtype=torch.int32)
        meta.kv_indices = torch.arange(1, rows * pages + 1, dtype=torch.int32)
        meta.context_lens = [16 * pages] * rows
        meta.kv_last_page_len = torch.full((rows,), 16, dtype=torch.int32)
        return meta

    if which == "prefill":
        def plan(i):
            backend.plan(null_meta(4, 100 + 30 * i, 16))
    else:
        wrapper = backend.graph_decode_wrapper(
            rows, torch.zeros(rows * 4, dtype=torch.int32, device=dev)) if which == "graph" \
            else backend.decode_wrapper

        def plan(i):
            backend.plan_decode(wrapper, decode(min(i, 2) + 1))
    plan(0)  # compiles, allocates
    torch.cuda.synchronize()
    for i in (1, 2, 3):
        torch.cuda._sleep(1_000_000_000)  # about half a second of device time
        t0 = time.perf_counter()
        plan(i)
        took = time.perf_counter() - t0
        torch.cuda.synchronize()
        assert took < 0.2, f"plan {i} waited {took:.2f} s for the device"
