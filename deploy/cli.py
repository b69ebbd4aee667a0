"""The ``baton`` command line.

``baton demo``      run a small model and print generated text and tokens/s
``baton generate``  offline generation with the engine
"""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small engine",
    "Question: what is two plus two? Answer:",
    "Prefill reads the whole prompt at once;",
]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="'tiny', 'dummy:Qwen3-<size>' or an HF folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)


def _generate(model: str, device: str, dtype: str | None, prompts: list, max_tokens: int,
              temperature: float) -> None:
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype)
    print(f"loaded {model} on {llm.engine.device} ({llm.engine.dtype}) in "
          f"{time.perf_counter() - t0:.1f}s; {llm.engine.pool.num_usable_blocks} KV blocks")
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        shown = out.text if out.text is not None else out.token_ids
        print(f"\n> {prompt!r}\n  {shown!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{total} tokens in {elapsed:.2f}s: {total / elapsed:.1f} tokens/s "
          f"({len(prompts)} requests, batched)")


def cmd_demo(args) -> None:
    import torch
    model = args.model or ("dummy:Qwen3-0.6B" if torch.cuda.is_available() else "tiny")
    prompts = DEMO_PROMPTS if model == "tiny" or not model.startswith("dummy:") else [
        [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    _generate(model, args.device, args.dtype, prompts, args.max_tokens, args.temperature)


def cmd_generate(args) -> None:
    prompts = [[int(t) for t in p.split(",")] if args.token_ids else p for p in args.prompt]
    _generate(args.model or "tiny", args.device, args.dtype, prompts, args.max_tokens,
              args.temperature)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a small model and print text and tokens/s")
    _engine_args(demo)
    gen = sub.add_parser("generate", help="offline generation")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--token-ids", action="store_true", help="prompts are comma-separated ids")
    args = parser.parse_args(argv)
    {"demo": cmd_demo, "generate": cmd_generate}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
