"""The engine's host work per decode step, with the model taken out: what the CPU spends on
scheduling, building a step's inputs, sampling bookkeeping and outputs while the GPU would be
idle when they run one after another (``async_scheduling=False``; the engine's default overlaps
them with the previous step's device work).

    python -m benchmarks.host_overhead --batch 1 64 256

Runs on CPU with the ``tiny`` model's engine; the forward pass is replaced by fixed logits, so
every figure is host time. Absolute numbers depend on the CPU; compare runs on one machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

PHASES = ("schedule", "prepare", "advance", "sample", "stop checks", "outputs")


def measure(batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=8192,
                                    max_num_seqs=max(batch, 1), show_progress=False,
                                    async_scheduling=False))
    logits = torch.zeros(batch, engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request([5 + i % 100] * prompt_len, params)
    engine.runner.execute = lambda b, prev=None: logits[: len(b.seqs)]
    for _ in range(5):  # prefill and a few decode steps
        engine.step()
    totals = dict.fromkeys(PHASES, 0.0)
    for _ in range(steps):
        t = [time.perf_counter()]
        batch_ = engine.scheduler.schedule()
        t.append(time.perf_counter())
        engine.runner.prepare(batch_)
        t.append(time.perf_counter())
        due = engine.scheduler.advance(batch_)
        t.append(time.perf_counter())
        tokens = engine.sampler(logits[: len(due)], due).tokens.tolist()
        t.append(time.perf_counter())
        for seq, token in zip(due, tokens):
            engine.updater.append(seq, token)
        t.append(time.perf_counter())
        for seq, token in zip(due, tokens):
            engine.updater.output(seq, [token], None)
        t.append(time.perf_counter())
        for name, a, b in zip(PHASES, t, t[1:]):
            totals[name] += b - a
    return {name: v / steps * 1e3 for name, v in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=300)
    args = ap.parse_args()
    print("| batch | " + " | ".join(PHASES) + " | total ms/step |")
    print("| ---: |" + " ---: |" * (len(PHASES) + 1))
    for b in args.batch:
        ms = measure(b, args.steps, args.prompt_len)
        print(f"| {b} | " + " | ".join(f"{ms[p]:.3f}" for p in PHASES)
              + f" | {sum(ms.values()):.3f} |", flush=True)


if __name__ == "__main__":
    main()
