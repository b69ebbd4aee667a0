"""Offline engine benchmarks on the GPU host, each against a ceiling measured in the same run.

    python -m benchmarks.engine_bench --tasks ceilings decode long throughput prefill hf \
        --json results/engine.json

Tasks (models are ``dummy:`` specs: random weights, real shapes):
- ``ceilings``: device copy GB/s (bytes read + written) and bf16 GEMM TFLOP/s.
- ``decode``: batch 1, 128-token prompt, 1024 new tokens: ms/token p50, tok/s, % of the
  weight-streaming floor (weights + KV read per step / copy bandwidth).
- ``long``: batch 1, a two-token prompt, 10,000 new tokens: seconds.
- ``throughput``: 256 sequences, input and output lengths uniform in [100, 1024] (seed 0):
  output tok/s and the decode steps' % of their memory floor.
- ``prefill``: batch 1, 1k/2k/8k-token prompts: ms and % of the compute floor (FLOPs / GEMM rate),
  back to back (also against the GEMM rate under the power limit) and after an idle second.
- ``hf``: transformers ``generate`` at batch 1 (same shape, bf16) for the ratio.
- ``sizes``: per model, with default settings: batch-1 decode ms/token and % of floor, a decode
  step of 64 sequences, throughput at the largest batch whose sequences all fit in the cache.
- ``mixed``: per model, a new prompt (16/128/480 tokens) joining a decoding batch (0/8/64
  sequences) every step: ms per step with the piecewise graphs and eagerly, against the batch's
  decode steps.
- ``overload``: per model, 256 requests at once into 64 slots, with the bounded wait
  (``starvation_timeout_s`` 1 s) and without: output tok/s, preemptions, TTFT p50/p99.
- ``spec``: per model, speculative decoding by n-gram (k 2, 4, 6) against none, at batch 1,
  8, 32 and 64, on repetitive prompts and random ones: output tok/s, the acceptance rate, the
  ratio to no speculation (random weights: what is accepted is whatever the model repeats).
- ``draft``: per model, speculative decoding by a draft model (``--draft-model``, k 4, 2 and 6)
  against none at batch 1, 8, 32 and 64: the draft verified, the draft with every or 70% of its
  proposals kept (timing at acceptance 1 and 0.7), the target as its own draft (k 4);
  ``--draft-quantization fp8``: the draft's weights in FP8 (``speculative_config``'s).
- ``onerow``: the decode graph alone (device time of one replay) at batch 1 with each one-row
  projection path (Triton skinny matmul with and without the RMSNorm folded in, cuBLAS), next to
  batch 64: how the engine's per-shape choice was made.
- ``replays``: the decode graph alone (device ms of one replay) at every captured batch size up
  to 32: a small batch's step, where the few-row kernels run (``kernels.fp8.fp8_skinny_mm``).
  Replayed as captured, over an empty context: the projections' and small kernels' time, not
  attention's (``profiler attention`` times graphs over real contexts).

- ``allreduce`` (with ``--tensor-parallel-size`` > 1): steady decode steps at batch 1, 64 and
  256 under the torch profiler: the NCCL kernels' share of rank 0's GPU time (the all-reduces
  and the logits' gather, waits for the other ranks included) and the step time.

``--quantization fp8`` and ``--kv-cache-dtype fp8`` run every task with FP8 weights / KV cache;
``--tensor-parallel-size N`` splits every engine over N GPUs (the floors are then per rank: its
slice of the weights and of the KV heads against one GPU's copy rate).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import replace

import torch

from benchmarks.lib import TENSOR_CORES, ceilings, cuda_ms, sustained_gemm_tflops
from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine


class Recorder:
    """Times every engine step and notes what it launched (decode-only? context tokens). With
    the engine one step ahead, a step's time is its launch plus the wait for the step before:
    in a steady run of decode steps, the time per step."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.steps = engine, []
        execute = engine.runner.execute

        def recording(batch, prev_tokens=None, draws=None):
            self._batch = (all(n == 1 for n in batch.num_new_tokens), len(batch.seqs),
                           sum(s.num_computed_tokens + n for s, n in
                               zip(batch.seqs, batch.num_new_tokens)), batch.num_tokens)
            return execute(batch, prev_tokens, draws)
        engine.runner.execute = recording

    def run(self) -> float:
        t_all = time.perf_counter()
        while self.engine.has_unfinished_requests():
            self._batch = None
            t0 = time.perf_counter()
            self.engine.step()
            if self._batch is not None:
                self.steps.append((*self._batch, time.perf_counter() - t0))
        return time.perf_counter() - t_all


def model_bytes(engine: LLMEngine) -> tuple[int, int]:
    """(weight bytes read by one decode step, KV bytes per context token), of rank 0: with
    tensor parallelism its slice of both, which every rank reads at once on its own GPU."""
    model, cfg = engine.model, engine.model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: the embedding is only gathered, row by row
        weights -= model.model.embed_tokens.weight.numel() * engine.dtype.itemsize
    kv = (cfg.num_hidden_layers * 2 * engine.runner.num_kv_heads * cfg.head_dim
          * engine.runner.kv_dtype.itemsize)
    return weights, kv


ENGINE_OPTIONS: dict = {}  # --quantization / --kv-cache-dtype / --tensor-parallel-size
_ENGINES: list = []  # made by the task running now; their other ranks stop after it


def _engine(model: str, **kw) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, device="cuda", show_progress=False,
                                    **{**ENGINE_OPTIONS, **kw}))
    _ENGINES.append(engine)
    return engine


def _release_engines() -> None:
    """Stop the engines the task made and give their GPU memory back before the next one."""
    while _ENGINES:
        _ENGINES.pop().shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def _options(engine: LLMEngine) -> dict:
    """What every row says of its engine."""
    mixed = engine.runner.mixed
    return {"weights": engine.weights_name, "kv_cache": str(engine.runner.kv_dtype)[6:],
            "tensor_parallel_size": engine.config.tensor_parallel_size,
            "graph_max_tokens": mixed.max_tokens if mixed else 0,
            "prompt_graph_max_tokens": mixed.prompt_sizes[-1] if mixed and mixed.prompt_sizes
            else 0,
            "lm_head": "fp8" if engine.model.lm_head_fp8 is not None else "bf16"}


def onerow(model: str, batches=(1, 64)) -> dict:
    """Device ms of one decode-graph replay per one-row projection path, and at batch 64."""
    engine = _engine(model, max_num_seqs=max(batches), cuda_graph_max_batch=max(batches))
    runner, graphs = engine.runner, engine.runner.graphs
    projs = [p for layers in engine.model.projections().values() for p in layers]
    saved = [(p, p.gemv_config, p.fuse_norm) for p in projs]
    head = engine.model.lm_head_gemv

    def replay_ms(size: int) -> float:
        graphs.capture(progress=False)
        return cuda_ms(graphs.graphs[size].replay, reps=50)

    row = {"task": "onerow", "model": model, "weights": engine.weights_name}
    row["batch1_engine_ms"] = round(replay_ms(1), 4)
    for p, _, _ in saved:
        p.fuse_norm = False
    row["batch1_gemv_unfused_ms"] = round(replay_ms(1), 4)
    for p, _, _ in saved:
        p.gemv_config = None
    engine.model.lm_head_gemv = None
    row["batch1_cublas_ms"] = round(replay_ms(1), 4)
    for p, cfg, fuse in saved:
        p.gemv_config, p.fuse_norm = cfg, fuse
    engine.model.lm_head_gemv = head
    for b in batches[1:]:
        row[f"batch{b}_ms"] = round(replay_ms(b), 4)
    row["norm_fused"] = runner.norm_fused
    return row


def replays(model: str, max_batch: int = 32) -> dict:
    """Device ms of one decode-graph replay at each captured batch size up to ``max_batch``,
    over the empty context the graphs were captured with (attention reads one null page)."""
    engine = _engine(model, max_num_seqs=max_batch)
    graphs = engine.runner.graphs
    graphs.capture(progress=False)
    return {"task": "replays", "model": model, "weights": engine.weights_name,
            "replay_ms": {size: round(cuda_ms(graphs.graphs[size].replay, reps=50), 4)
                          for size in sorted(graphs.graphs) if size <= max_batch}}


def _prompt(engine: LLMEngine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, engine.vocab_size - 10, (n,), generator=g).tolist()


def decode(model: str, ceil: dict, prompt_len: int = 128, new: int = 1024) -> dict:
    engine = _engine(model, max_num_seqs=8, max_num_batched_tokens=max(8192, prompt_len))
    engine.add_request(_prompt(engine, prompt_len, 0),
                       SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    Recorder(engine).run()  # warm
    engine.add_request(_prompt(engine, prompt_len, 1),
                       SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    rec = Recorder(engine)
    rec.run()
    steps = [s for s in rec.steps if s[0]]
    weights, kv_tok = model_bytes(engine)
    ms = statistics.median(s[4] for s in steps) * 1e3
    floor_ms = statistics.median((weights + kv_tok * s[2]) / (ceil["copy_GBps"] * 1e9) * 1e3
                                 for s in steps)
    total = sum(s[4] for s in steps)
    return {"task": "decode", "model": model, **_options(engine), "prompt_len": prompt_len,
            "ms_per_token_p50": round(ms, 3),
            "tok_s": round(len(steps) / total, 1), "floor_ms": round(floor_ms, 3),
            "pct_of_floor": round(100 * floor_ms / ms, 1), "startup_s": round(engine.startup_s, 1),
            "warm_up_s": round(engine.runner.warm_up_s, 1),
            "one_row_gemv": {n: list(c) if c else "cublas"
                             for n, c in engine.runner.gemv_choices.items()},
            "norm_fused": engine.runner.norm_fused}


def sizes(model: str, ceil: dict, lo: int = 100, hi: int = 1024) -> dict:
    """One row per model size: batch-1 decode (ms/token, % of floor), a decode step of 64
    sequences, and throughput at the largest batch whose sequences all fit in the KV cache at
    once (in/out lengths uniform in [lo, hi]), on one engine with default settings."""
    engine = _engine(model)
    weights, kv_tok = model_bytes(engine)

    def decode_steps(n: int, new: int) -> list:
        for i in range(n):
            engine.add_request(_prompt(engine, 128, 1000 + i),
                               SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        rec = Recorder(engine)
        rec.run()
        return [st for st in rec.steps if st[0] and st[1] == n]

    decode_steps(1, 8)  # warm
    one = decode_steps(1, 256)
    ms1 = statistics.median(st[4] for st in one) * 1e3
    floor1 = statistics.median((weights + kv_tok * st[2]) / (ceil["copy_GBps"] * 1e9) * 1e3
                               for st in one)
    ms64 = statistics.median(st[4] for st in decode_steps(64, 64)) * 1e3
    fit = min(256, engine.pool.num_usable_blocks * engine.config.block_size // (2 * hi))
    g = torch.Generator().manual_seed(0)
    ins = torch.randint(lo, hi + 1, (fit,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (fit,), generator=g).tolist()
    for i, (a, b) in enumerate(zip(ins, outs)):
        engine.add_request(_prompt(engine, a, i),
                           SamplingParams(temperature=0, max_tokens=b, ignore_eos=True))
    seconds = Recorder(engine).run()
    return {"task": "sizes", "model": model, **_options(engine),
            "weights_GB": round(weights / 1e9, 2),
            "kv_cache_tokens": engine.pool.num_usable_blocks * engine.config.block_size,
            "batch1_ms_per_token": round(ms1, 3), "batch1_floor_ms": round(floor1, 3),
            "batch1_pct_of_floor": round(100 * floor1 / ms1, 1),
            "batch64_ms_per_step": round(ms64, 3), "throughput_seqs": fit,
            "throughput_tok_s": round(sum(outs) / seconds, 1),
            "preemptions": engine.scheduler.num_preemptions,
            "decode_tensor_cores": engine.runner.backend.decode_tensor_cores}


def long_run(model: str, new: int = 10_000) -> dict:
    engine = _engine(model, max_num_seqs=8)
    engine.add_request([6023, 1052], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    Recorder(engine).run()
    engine.add_request([6023, 1052], SamplingParams(temperature=0, max_tokens=new,
                                                    ignore_eos=True))
    seconds = Recorder(engine).run()
    return {"task": "long", "model": model, "new_tokens": new, "seconds": round(seconds, 2),
            "ms_per_token": round(seconds / new * 1e3, 3)}


def throughput(model: str, ceil: dict, n: int = 256, lo: int = 100, hi: int = 1024) -> dict:
    engine = _engine(model, max_num_seqs=n)
    g = torch.Generator().manual_seed(0)
    ins = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    engine.add_request(_prompt(engine, 64, 99),
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    Recorder(engine).run()  # warm
    for i, (a, b) in enumerate(zip(ins, outs)):
        engine.add_request(_prompt(engine, a, i),
                           SamplingParams(temperature=0, max_tokens=b, ignore_eos=True))
    rec = Recorder(engine)
    seconds = rec.run()
    weights, kv_tok = model_bytes(engine)
    dec = [s for s in rec.steps if s[0]]
    dec_s = sum(s[4] for s in dec)
    floor_s = sum((weights + kv_tok * s[2]) / (ceil["copy_GBps"] * 1e9) for s in dec)
    return {"task": "throughput", "model": model, **_options(engine),
            "decode_tensor_cores": engine.runner.backend.decode_tensor_cores, "seqs": n,
            "kv_cache_tokens": engine.pool.num_usable_blocks * engine.config.block_size,
            "seconds": round(seconds, 1),
            "output_tok_s": round(sum(outs) / seconds, 1),
            "decode_steps": len(dec), "decode_s": round(dec_s, 2),
            "decode_pct_of_floor": round(100 * floor_s / dec_s, 1),
            "preemptions": engine.scheduler.num_preemptions}


def allreduce(model: str, batches=(1, 64, 256), steps: int = 30) -> list[dict]:
    """The NCCL kernels' share of rank 0's GPU time over ``steps`` steady decode steps at each
    batch size (torch profiler; a CUDA graph's kernels are listed one by one)."""
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(model, max_num_seqs=max(batches))
    rows = []
    for n in batches:
        for i in range(n):
            engine.add_request(_prompt(engine, 128, 500 + i),
                               SamplingParams(temperature=0, max_tokens=2 * steps + 16,
                                              ignore_eos=True))
        for _ in range(8):  # every prompt prefilled: decode steps only from here
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / steps * 1e3
        while engine.has_unfinished_requests():
            engine.step()
        kernels = [(e.key, e.device_time_total) for e in prof.key_averages()]
        total = sum(t for _, t in kernels)
        nccl = sum(t for k, t in kernels if "nccl" in k.lower())
        rows.append({"task": "allreduce", "model": model, **_options(engine), "batch": n,
                     "step_ms": round(step_ms, 3), "gpu_ms_per_step": round(total / steps / 1e3, 3),
                     "nccl_ms_per_step": round(nccl / steps / 1e3, 3),
                     "nccl_share": round(nccl / total, 3) if total else 0.0})
    return rows


def prefill(model: str, ceil: dict, lengths=(1024, 2048, 8192), idle_s: float = 1.0) -> list[dict]:
    """Each prompt alone, timed two ways: back to back (``ms``: the median of reps 2-4), and
    after ``idle_s`` of an idle GPU (``ms_from_idle``: a first token at zero load; 0 skips it).
    The floor is the FLOPs at the burst GEMM ceiling (``x_floor``, ``x_floor_from_idle``); the
    back-to-back figure also against the GEMM rate under the power limit
    (``x_floor_sustained``, :func:`benchmarks.lib.sustained_gemm_tflops`), since prompts back to
    back run at the capped clocks."""
    engine = _engine(model, max_num_seqs=4, max_num_batched_tokens=max(lengths),
                     enable_prefix_caching=False)
    cfg = engine.model.config
    params = sum(p.numel() for p in engine.model.parameters()) - cfg.vocab_size * cfg.hidden_size
    sustained = sustained_gemm_tflops()

    def timed(n: int, rep: int) -> float:
        engine.add_request(_prompt(engine, n, rep), SamplingParams(temperature=0, max_tokens=1))
        torch.cuda.synchronize()
        return Recorder(engine).run()  # the prefill step and the wait for its token

    rows = []
    for n in lengths:
        ms = statistics.median([timed(n, rep) for rep in range(4)][1:]) * 1e3
        idle = []
        for rep in range(3 if idle_s > 0 else 0):
            time.sleep(idle_s)
            idle.append(timed(n, 10 + rep))
        attn = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * n * (n + 1) / 2 \
            * cfg.num_hidden_layers / engine.config.tensor_parallel_size  # this rank's heads
        flops = 2 * params * n + attn + 2 * cfg.hidden_size * cfg.vocab_size
        floor_ms = flops / (ceil["gemm_TFLOPs"] * 1e12) * 1e3
        row = {"task": "prefill", "model": model, **_options(engine), "tokens": n,
               "ms": round(ms, 2), "floor_ms": round(floor_ms, 2),
               "pct_of_floor": round(100 * floor_ms / ms, 1), "x_floor": round(ms / floor_ms, 2),
               "gemm_TFLOPs_sustained": round(sustained, 1),
               "x_floor_sustained": round(ms / (flops / (sustained * 1e12) * 1e3), 3),
               "startup_s": round(engine.startup_s, 1)}
        if idle:
            from_idle = statistics.median(idle) * 1e3
            row.update(ms_from_idle=round(from_idle, 2),
                       x_floor_from_idle=round(from_idle / floor_ms, 3))
        rows.append(row)
    return rows


def mixed(model: str, batches=(0, 8, 64), prompt_lens=(16, 128, 480), steps: int = 30
          ) -> list[dict]:
    """Steps that prefill a prompt beside a decoding batch, with the piecewise graphs and
    eagerly (``cuda_graph_max_tokens`` 0): ``batch`` sequences decode (128-token prompts, no
    end) while one new prompt of ``prompt_len`` tokens (``max_tokens`` 1) joins every step.
    Wall ms per step (the engine one step ahead: a step's launch and the wait for the one
    before), against the same batch's decode steps with no prompt joining."""
    rows = []
    for graphed in (True, False):
        rows += _mixed_rows(model, graphed, batches, prompt_lens, steps)
        _release_engines()
    return rows


def _mixed_rows(model: str, graphed: bool, batches, prompt_lens, steps: int) -> list[dict]:
    engine = _engine(model, max_num_seqs=max(batches) + 2,
                     **({} if graphed else {"cuda_graph_max_tokens": 0}))
    seeds = iter(range(1000, 10**6))

    def timed(n: int, prompt_len: int | None) -> float:
        t = []
        for _ in range(n):
            if prompt_len:
                engine.add_request(_prompt(engine, prompt_len, next(seeds)),
                                   SamplingParams(temperature=0, max_tokens=1))
            t0 = time.perf_counter()
            engine.step()
            t.append(time.perf_counter() - t0)
        return statistics.median(t[n // 3:]) * 1e3

    rows = []
    for b in batches:
        ids = [engine.add_request(_prompt(engine, 128, i), SamplingParams(
            temperature=0, max_tokens=100_000, ignore_eos=True)) for i in range(b)]
        timed(8, None)  # prefilled, decoding
        decode_ms = timed(steps, None) if b else 0.0
        for n in prompt_lens:
            timed(4, n)  # warm
            rows.append({"task": "mixed", "model": model, **_options(engine),
                         "piecewise_graphs": graphed, "batch": b, "prompt_tokens": n,
                         "decode_step_ms": round(decode_ms, 2),
                         "mixed_step_ms": round(timed(steps, n), 2)})
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return rows


def overload(model: str, seqs: int = 64, n: int = 256, prompt_len: int = 128,
             new: int = 512) -> list[dict]:
    """The bounded wait's cost under persistent overload: ``n`` requests at once (four times
    ``max_num_seqs``) with ``starvation_timeout_s`` 1 s (the default) and off. Output tok/s,
    preemptions (by recompute), and the requests' time to first token p50/p99."""
    rows = []
    for timeout in (1.0, None):
        engine = _engine(model, max_num_seqs=seqs, starvation_timeout_s=timeout)
        engine.add_request(_prompt(engine, 64, 99),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        Recorder(engine).run()  # warm
        t0, first = time.perf_counter(), {}
        for i in range(n):
            engine.add_request(_prompt(engine, prompt_len, i), SamplingParams(
                temperature=0, max_tokens=new, ignore_eos=True), request_id=f"o{i}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        ttft = sorted(first.values())
        rows.append({"task": "overload", "model": model, **_options(engine),
                     "max_num_seqs": seqs, "requests": n, "starvation_timeout_s": timeout,
                     "seconds": round(seconds, 2), "output_tok_s": round(n * new / seconds, 1),
                     "preemptions": engine.scheduler.num_preemptions,
                     "starvation_preemptions": engine.scheduler.num_starvation_preemptions,
                     "ttft_p50_s": round(ttft[len(ttft) // 2], 2),
                     "ttft_p99_s": round(ttft[int(len(ttft) * 0.99)], 2)})
        del engine
        _release_engines()
    return rows


def _forcing(percent: int):
    """A verification that keeps ``percent`` of the proposals, the first of each sequence's
    (``forced``: all; ``kept70``: 70%, 2 or 3 of 4 in turn), for timing at that acceptance:
    the tokens are not the target's."""
    import itertools

    from engine.spec_decode import verify

    turns = itertools.count()

    def verify_forced(sampler, logits, seqs, drafts, stats=None, *rest, **kw):
        out, ids = verify(sampler, logits, seqs, drafts, None, *rest, **kw)
        tokens = []
        for d, o in zip(drafts, out):
            c = next(turns)
            n = (c + 1) * percent * len(d) // 100 - c * percent * len(d) // 100
            stats.add(d, n)
            tokens.append(d[:n] + o[-1:])
        return tokens, ids
    return verify_forced


FORCED = {"forced": 100, "kept70": 70}  # timing points: the share of proposals kept


def _spec_point(engine: LLMEngine, text: str, batch: int, prompt_len: int, new: int) -> dict:
    """Output tok/s, acceptance and steps of ``batch`` prompts (``repetitive``: a 16-token
    phrase over and over; else random) decoding ``new`` tokens each, greedy; speculation on at
    the start as in a fresh engine."""
    from engine.spec_decode import SpecController

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    prompts = [(_prompt(engine, 16, 100 + i) * (prompt_len // 16) if text == "repetitive"
                else _prompt(engine, prompt_len, 100 + i)) for i in range(batch)]
    engine.reset_prefix_cache()
    if engine.spec is not None:
        engine.spec = SpecController()
    before = replace(engine.spec_stats)
    for p in prompts:
        engine.add_request(p, params)
    torch.cuda.synchronize()
    t0, steps0, made = time.perf_counter(), engine.stats.steps, 0
    while engine.has_unfinished_requests():
        made += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - t0
    stats = engine.spec_stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    steps = engine.stats.steps - steps0
    return {"prompts": text, "batch": batch, "tok_s": round(made / seconds, 1),
            "acceptance": round((stats.num_accepted_tokens - before.num_accepted_tokens)
                                / drafted, 3) if drafted else None,
            "steps": steps, "step_ms": round(seconds / steps * 1e3, 3)}


def _warm(engine: LLMEngine) -> None:
    engine.add_request(_prompt(engine, 16, 99) * 4, SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        engine.step()


def _against_none(rows: list[dict]) -> list[dict]:
    """Each row's tok/s over the engine's without speculation on the same prompts and batch
    (``forced`` points against ``random`` ones)."""
    base = {(r["prompts"], r["batch"]): r["tok_s"] for r in rows if r["k"] == 0}
    base |= {(f, b): t for (p, b), t in base.items() if p == "random" for f in FORCED}
    for r in rows:
        r["x_no_speculation"] = round(r["tok_s"] / base[r["prompts"], r["batch"]], 3)
    return rows


def spec(model: str, ks=(0, 2, 4, 6), batches=(1, 8, 32, 64), prompt_len: int = 128,
         new: int = 256) -> list[dict]:
    """Speculative decoding by n-gram against none: output tok/s and the acceptance rate at each
    batch. Proposals on repetitive prompts and on random ones (random weights rarely repeat
    themselves: little to propose, the cost of looking), and ``forced``/``kept70``: random
    prompts, ``k`` proposals at every step, all or 70% kept: the step cost of verification at
    acceptance 1 or 0.7, for timing only (the tokens are not the target's: a bf16 target with
    random weights has near-ties that its own continuation, made by the decode path, does not
    survive on the verification path, so no real proposer reaches acceptance 1 on it). ``k`` 0
    is the engine without speculation (one step ahead, as by default)."""
    import engine.llm_engine as llm_engine
    from engine.spec_decode import verify

    rows = []
    for k in ks:
        config = {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}} \
            if k else {}
        engine = _engine(model, max_num_seqs=max(batches), **config)
        ngram = engine.propose if k else None
        _warm(engine)
        for text in ("repetitive", "random", *FORCED):
            if text in FORCED and not k:
                continue
            if k:
                engine.propose = (lambda seq, limit: [seq.token_ids[-1]] * min(limit, k)) \
                    if text in FORCED else ngram
                llm_engine.verify = _forcing(FORCED[text]) if text in FORCED else verify
            for batch in batches:
                rows.append({"task": "spec", "model": model, **_options(engine), "k": k,
                             **_spec_point(engine, text, batch, prompt_len, new)})
        llm_engine.verify = verify
        del engine, ngram  # the next k's engine needs its memory
        _release_engines()
    return _against_none(rows)


def draft(model: str, draft_model: str, ks=(4, 2, 6), batches=(1, 8, 32, 64),
          prompt_len: int = 128, new: int = 256, quantization: str | None = None,
          own: bool = True, fp8_lm_head: bool = False) -> list[dict]:
    """Speculative decoding by a draft model against none, on random prompts: ``draft_model``
    proposing ``k`` tokens, verified (random weights: a draft other than the target itself
    agrees with it by chance only, so speculation should turn itself off), and
    ``forced``/``kept70``, every proposal or 70% kept (the cost of the draft's ``k`` steps and
    the verification at acceptance 1 or 0.7, for timing); and the target as its own draft at
    the first ``k``, verified (acceptance near 1, less the near-ties of random bf16 weights;
    ``own`` False: not run). ``quantization``, ``fp8_lm_head``: the draft's
    (``speculative_config``'s)."""
    import engine.llm_engine as llm_engine
    from engine.spec_decode import verify

    rows = []
    runs = ([("none", 0), (draft_model, ks[0])] + [(model, ks[0])] * own
            + [(draft_model, k) for k in ks[1:]])
    for name, k_ in runs:
        config = {"speculative_config": {
            "method": "draft_model", "model": name, "num_speculative_tokens": k_,
            "quantization": quantization if name == draft_model else None,
            "fp8_lm_head": True if fp8_lm_head and name == draft_model else None}} \
            if k_ else {}
        engine = _engine(model, max_num_seqs=max(batches), **config)
        _warm(engine)
        for text in ("random", *FORCED):
            if text in FORCED and (not k_ or name == model):
                continue
            llm_engine.verify = _forcing(FORCED[text]) if text in FORCED else verify
            for batch in batches:
                drafter = engine.drafter
                steps0 = drafter.steps if drafter else 0
                ahead0 = drafter.steps_ahead if drafter else 0
                row = _spec_point(engine, text, batch, prompt_len, new)
                ours = bool(k_) and name == draft_model
                rows.append({"task": "draft", "model": model, **_options(engine), "k": k_,
                             "draft": name if k_ else None,
                             "draft_quantization": quantization if ours else None,
                             "draft_fp8_lm_head": fp8_lm_head and ours, **row,
                             "draft_steps": drafter.steps - steps0 if drafter else 0,
                             "draft_steps_ahead": drafter.steps_ahead - ahead0 if drafter
                             else 0})
        llm_engine.verify = verify
        del engine
        _release_engines()
    return _against_none(rows)


def hf_generate(model: str, prompt_len: int = 128, new: int = 128) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine.model_source import resolve_model
    shape = resolve_model(model).config
    config = Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=4096)
    with torch.device("cuda"):
        hf = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(10, shape.vocab_size - 10, (1, prompt_len), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    hf.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    torch.cuda.synchronize()
    return {"task": "hf", "model": model, "tok_s": round(new / (time.perf_counter() - t0), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["ceilings", "decode", "long", "throughput",
                                                   "prefill", "hf"])
    ap.add_argument("--decode-models", nargs="+", default=["dummy:Qwen3-0.6B", "dummy:Qwen3-8B"])
    ap.add_argument("--prefill-model", default="dummy:Qwen3-8B")
    ap.add_argument("--draft-model", default="dummy:Qwen3-0.6B",
                    help="the draft of the draft task (speculative decoding)")
    ap.add_argument("--draft-quantization", choices=["fp8"], default=None,
                    help="the draft's weights (speculative_config's quantization)")
    ap.add_argument("--draft-fp8-lm-head", action="store_true",
                    help="the draft's LM head in FP8 (speculative_config's fp8_lm_head)")
    ap.add_argument("--decode-prompt-len", type=int, default=128,
                    help="prompt tokens of the batch-1 decode task (8192: decode at 8k context)")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--decode-tensor-cores", choices=list(TENSOR_CORES), default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--fp8-lm-head", action="store_true", help="the engine's fp8_lm_head")
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=None,
                    help="the engine's cuda_graph_max_tokens (default: the engine's default)")
    ap.add_argument("--cuda-graph-prompt-max-tokens", type=int, default=None,
                    help="the engine's cuda_graph_prompt_max_tokens (0: no lone-prompt graphs; "
                    "default: the engine's default)")
    ap.add_argument("--prefill-lengths", default="1024,2048,8192",
                    help="prompt lengths of the prefill task, comma-separated")
    ap.add_argument("--prefill-idle-s", type=float, default=1.0,
                    help="the prefill task's idle seconds before each of its prompts timed from "
                    "an idle GPU (0: only back to back)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ENGINE_OPTIONS.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                          tensor_parallel_size=args.tensor_parallel_size,
                          decode_tensor_cores=TENSOR_CORES[args.decode_tensor_cores])
    for option in ("cuda_graph_max_tokens", "cuda_graph_prompt_max_tokens"):
        if getattr(args, option) is not None:
            ENGINE_OPTIONS[option] = getattr(args, option)
    if args.fp8_lm_head:
        ENGINE_OPTIONS["fp8_lm_head"] = True
    ceil = ceilings()
    rows = [{"task": "ceilings", **ceil}]
    print(json.dumps(rows[0]), flush=True)

    def emit(result):
        for r in result if isinstance(result, list) else [result]:
            rows.append(r)
            print(json.dumps(r), flush=True)
        _release_engines()

    for model in args.decode_models:
        if "sizes" in args.tasks:
            emit(sizes(model, ceil))
        if "onerow" in args.tasks:
            emit(onerow(model))
        if "replays" in args.tasks:
            emit(replays(model))
        if "decode" in args.tasks:
            emit(decode(model, ceil, prompt_len=args.decode_prompt_len))
        if "throughput" in args.tasks:
            emit(throughput(model, ceil))
        if "allreduce" in args.tasks and args.tensor_parallel_size > 1:
            emit(allreduce(model))
        if "mixed" in args.tasks:
            emit(mixed(model))
        if "overload" in args.tasks:
            emit(overload(model))
        if "spec" in args.tasks:
            emit(spec(model))
        if "draft" in args.tasks:
            emit(draft(model, args.draft_model, quantization=args.draft_quantization,
                       fp8_lm_head=args.draft_fp8_lm_head))
        if "hf" in args.tasks:
            emit(hf_generate(model))
    if "long" in args.tasks:
        emit(long_run("dummy:Qwen3-0.6B"))
    if "prefill" in args.tasks:
        emit(prefill(args.prefill_model, ceil,
                     tuple(int(n) for n in args.prefill_lengths.split(",")),
                     idle_s=args.prefill_idle_s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
