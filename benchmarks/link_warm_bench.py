"""What a link's first push costs, and what warming it first saves.

A prefill server in a child process and a decode server here (the role servers the deployments
run). For each backend, twice: a fresh pair whose first request opens the link itself, then a
fresh pair whose link was warmed first (``LinkWarmer``: connect + a one-block write). Prints
the warming's own time and each request's push time (``usage.kv_transfer.seconds``):

    python -m benchmarks.link_warm_bench                                  # GPU: cuda_ipc, nixl
    UCX_NET_DEVICES=lo python -m benchmarks.link_warm_bench --device cpu  # nixl over DRAM
"""

from __future__ import annotations

import argparse
import asyncio
import json

from contracts import TokenSink
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import EngineConfig, SamplingParams
from tests.models import random_prompts
from tests.roles import Peer, PeerPrefillHandle, generate


async def _requests(decode, prompts, params) -> list[float]:
    sink = TokenSink()
    try:
        out = []
        for i, prompt in enumerate(prompts):
            _, result = await generate(decode, sink, prompt, f"r{i}", params)
            out.append(result.transfer.seconds)
        return out
    finally:
        await sink.close()


def run(config: EngineConfig, backend: str, warm: bool, prompts) -> dict:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefill = Peer("prefill", config, backend)
    decode = DecodeServer(config, backend, PeerPrefillHandle(prefill), disaggregation=ALWAYS)
    try:
        link = prefill.call("warm", decode.endpoint.info()) if warm else None
        pushes = asyncio.run(_requests(decode, prompts, params))
    finally:
        prefill.stop()
        decode.close()
    return {"backend": backend, "warmed": warm,
            "warm_ms": round(link["seconds"] * 1e3, 2) if link else None,
            "push_ms": [round(s * 1e3, 2) for s in pushes]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="default: dummy:Qwen3-0.6B on cuda, tiny on cpu")
    p.add_argument("--backends", nargs="*", default=None)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    model = args.model or ("dummy:Qwen3-0.6B" if gpu else "tiny")
    backends = args.backends or (["cuda_ipc", "nixl"] if gpu else ["nixl"])
    config = EngineConfig(model=model, device=args.device, dtype="bfloat16" if gpu else None,
                          num_blocks=256, max_num_seqs=8, show_progress=False)
    vocab = 151936 if model.startswith("dummy:") else 512
    prompts = random_prompts([args.prompt_len] * args.requests, vocab=vocab, seed=3)
    rows = [run(config, b, warm, prompts) for b in backends for warm in (False, True)]
    print(f"\n{'backend':9} {'warmed':>6} {'warm ms':>8}  push ms (request 1, 2, ...)")
    for r in rows:
        print(f"{r['backend']:9} {str(r['warmed']):>6} {str(r['warm_ms'] or '-'):>8}  "
              + ", ".join(f"{x:.2f}" for x in r["push_ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
