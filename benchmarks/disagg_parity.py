"""1 prefill + 1 decode server (the roles as they ship) on the GPU host: same greedy tokens as a colocated engine, and
the hand-over time next to the prefill time (is overlapping the push with prefill worth it?).

    python -m benchmarks.disagg_parity --model dummy:Qwen3-8B --backends cuda_ipc nixl
    python -m benchmarks.disagg_parity --model dummy:Qwen3-8B --backends nccl nixl \\
        --prefill-device cuda:1        # two GPUs
    python -m benchmarks.disagg_parity --model MODEL --dtype float32 --backends cuda_ipc \\
        --prefill-tp 2 --decode-device cuda:1     # a split prefill replica (GPUs 0 and 1)

With ``--prefill-tp`` / ``--decode-tp`` a role's engine is split over that many GPUs from its
device on; the colocated reference is one rank on the decode device. A ``dummy:`` model's weights
are drawn per rank, so a split dummy model is another model: compare tokens on a checkpoint on
disk. Where the hand-over crosses GPUs, its GB/s is set against a peer copy of the same bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from contracts import TokenSink
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from benchmarks.lib import copy_ceiling
from tests.roles import Peer, PeerPrefillHandle, generate


def _reference_tokens(config: EngineConfig, prompts, params, queue) -> None:
    llm = LLM(**config.model_dump())
    queue.put([llm.generate([p], params)[0].token_ids for p in prompts])


def reference_in_child(config: EngineConfig, prompts, params) -> list[list[int]]:
    """The colocated tokens computed by a fresh process (is the reference itself stable across
    processes?)."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_reference_tokens, args=(config, prompts, params, queue))
    proc.start()
    try:
        return queue.get(timeout=300)
    finally:
        proc.join(30)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:Qwen3-8B")
    p.add_argument("--backends", nargs="*", default=["cuda_ipc", "nixl"])
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:0")
    p.add_argument("--lengths", type=int, nargs="*", default=[2048, 700, 33, 5])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=400)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--allow-mismatch", action="store_true",
                   help="report different tokens without failing (bf16 over different splits)")
    p.add_argument("--reference-process", action="store_true",
                   help="also compute the colocated tokens in a second, fresh process")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    def config(device, tp=1):
        return EngineConfig(model=args.model, device=device, num_blocks=args.num_blocks,
                            dtype=args.dtype, max_num_seqs=16, max_num_batched_tokens=4096,
                            tensor_parallel_size=tp)

    gen = torch.Generator().manual_seed(0)
    reference = config(args.decode_device).model_copy(update={"enable_prefix_caching": False})
    colocated = LLM(args.model, **reference.model_dump(exclude={"model"}))
    vocab = colocated.engine.vocab_size
    prompts = [torch.randint(10, vocab - 10, (n,), generator=gen).tolist() for n in args.lengths]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    # One prompt at a time, as the disaggregated run serves them: the same shapes reach the
    # same kernels, so bf16 results are comparable bit for bit.
    expected = [colocated.generate([p], greedy)[0].token_ids for p in prompts]
    print(f"colocated: {len(prompts)} prompts in {time.perf_counter() - t0:.2f}s")
    again = [colocated.generate([p], greedy)[0].token_ids for p in prompts]
    print(f"colocated reference repeats itself: {again == expected}")
    del colocated
    torch.cuda.empty_cache()
    if args.reference_process:
        other = reference_in_child(reference, prompts, greedy)
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                  for x, y in zip(other, expected)]
        print(f"colocated reference in a second process: same={other == expected}, "
              f"first differences per prompt: {firsts}")

    rows, errors = [], {}

    async def run(decode, backend):
        sink = TokenSink()
        for i, (prompt, want) in enumerate(zip(prompts, expected)):
            got, result = await generate(decode, sink, prompt, f"{backend}-{i}", greedy)
            st, timing = result.transfer, result.timing
            diverge = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            rows.append(dict(backend=backend, prompt_tokens=len(prompt),
                             same_tokens=got == want, first_difference=diverge,
                             tokens=got, expected=want,
                             prefill_ms=result.prefill_seconds * 1e3,
                             handover_ms=st.seconds * 1e3 if st else float("nan"),
                             mbytes=st.bytes / 1e6 if st else 0.0,
                             blocks_sent=st.blocks_sent if st else 0,
                             admit_ms=(timing.queued - timing.prefill_returned) * 1e3))
        await sink.close()

    for backend in args.backends:
        prefill = decode = None
        try:
            prefill = Peer("prefill", config(args.prefill_device, args.prefill_tp), backend)
            decode = DecodeServer(config(args.decode_device, args.decode_tp), backend,
                                  PeerPrefillHandle(prefill), 60.0, disaggregation=ALWAYS)
            asyncio.run(run(decode, backend))
        except Exception as exc:  # noqa: BLE001 - report, go on with the next backend
            errors[backend] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"{backend}: FAILED: {errors[backend]}")
        finally:
            if prefill is not None:
                prefill.stop()
            if decode is not None:
                decode.close()
    devices = _devices(args)
    ceiling = None
    if len(devices) > 1 and rows:  # a peer copy of the largest hand-over's bytes
        ceiling = copy_ceiling(("cuda:0", "cuda:1"), int(max(r["mbytes"] for r in rows) * 1e6))
    for r in rows:
        r["GBps"] = r["mbytes"] / r["handover_ms"] if r["handover_ms"] > 0 else float("nan")
        r["pct_of_peer_copy"] = 100 * r["GBps"] * 1e9 / ceiling if ceiling else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, errors=errors, prefill_tp=args.prefill_tp,
                           decode_tp=args.decode_tp, devices=sorted(devices),
                           peer_copy_GBps=ceiling / 1e9 if ceiling else None), f, indent=1)
    print(f"\nprefill over {args.prefill_tp} rank(s) from {args.prefill_device}, decode over "
          f"{args.decode_tp} from {args.decode_device}"
          + (f"; peer copy {ceiling / 1e9:.0f} GB/s" if ceiling else ""))
    print(f"{'backend':9} {'prompt':>6} {'same':>5} {'diff@':>5} {'prefill ms':>10} "
          f"{'push ms':>8} {'MB':>7} {'GB/s':>6} {'%peer':>5} {'push/prefill':>12}")
    for r in rows:
        pct = f"{r['pct_of_peer_copy']:5.0f}" if r["pct_of_peer_copy"] is not None else "    -"
        print(f"{r['backend']:9} {r['prompt_tokens']:6d} {str(r['same_tokens']):>5} "
              f"{'-' if r['first_difference'] is None else r['first_difference']:>5} "
              f"{r['prefill_ms']:10.1f} {r['handover_ms']:8.3f} {r['mbytes']:7.1f} "
              f"{r['GBps']:6.1f} {pct} {r['handover_ms'] / r['prefill_ms']:12.4f}")
    if errors or not (args.allow_mismatch or all(r["same_tokens"] for r in rows)):
        raise SystemExit("token mismatch between disaggregated and colocated")


def _devices(args) -> set[str]:
    """The GPUs the two roles' ranks sit on."""
    def ranks(device: str, tp: int) -> set[str]:
        if not device.startswith("cuda"):
            return {device}
        first = int(device.partition(":")[2] or 0)
        return {f"cuda:{first + r}" for r in range(tp)}
    return ranks(args.prefill_device, args.prefill_tp) | ranks(args.decode_device, args.decode_tp)


if __name__ == "__main__":
    main()
