"""A prefill server in a child process pushes KV into a decode server in this process (the role
servers as they ship), over NIXL (host memory over UCX) and gloo (the CPU stand-in for NCCL); and
the README's hand-over example, run as written in a process of its own."""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from contracts import TokenSink
from contracts.messages import PrefillRequest
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer import TransferError, TransferState
from tests.models import random_prompts

pytestmark = pytest.mark.slow  # real processes per test: ~40 s of the suite
from tests.roles import (NoPrefill, Peer, PeerPrefillHandle, capture_landed_kv, generate,
                         until_idle)

CONFIG = EngineConfig(model="tiny", num_blocks=256, show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts([5, 16, 37, 64], vocab=512, seed=11)


@pytest.fixture(scope="module")
def colocated():
    return LLM("tiny")


@pytest.fixture(scope="module", params=["nixl", "nccl"])
def pair(request):
    prefill = Peer("prefill", CONFIG, request.param)
    handle = PeerPrefillHandle(prefill)
    decode = DecodeServer(CONFIG, request.param, handle, disaggregation=ALWAYS)
    landed = capture_landed_kv(decode)
    yield prefill, handle, decode, landed
    prefill.stop()
    decode.close()


def _disaggregated(pair, prompt, rid, params=GREEDY):
    _, handle, decode, landed = pair

    async def main():
        sink = TokenSink()
        tokens, result = await generate(decode, sink, prompt, rid, params)
        await until_idle(decode)
        await sink.close()
        return tokens, result

    tokens, result = asyncio.run(main())
    return tokens, result, handle.pushed.get(rid), landed.get(rid)


def _assert_idle(prefill_peer):
    assert prefill_peer.call("gauges") == (0, 0)


def test_blocks_arrive_byte_identical_and_decode_matches_colocated(pair, colocated):
    expected = [o.token_ids for o in colocated.generate(PROMPTS, GREEDY)]
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, expected)):
        got, result, src_kv, dst_kv = _disaggregated(pair, prompt, f"a{i}")
        assert torch.equal(src_kv, dst_kv)
        assert result.transfer.blocks_sent == -(-len(prompt) // 16)
        assert result.transfer.bytes == src_kv.numel() * src_kv.element_size()
        assert got == tokens
    _assert_idle(pair[0])


def test_only_missing_blocks_move_when_receiver_holds_a_prefix(pair, colocated):
    decode = pair[2]
    shared = random_prompts([48], vocab=512, seed=12)[0]
    # The decode engine serves the shared prefix itself first, so its cache holds 3 blocks.
    async def serve_shared():
        await decode.aengine.call(lambda e: e.add_request(shared, GREEDY, "shared"))
        await until_idle(decode)

    asyncio.run(serve_shared())
    prompt = shared + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    got, result, src_kv, dst_kv = _disaggregated(pair, prompt, "b")
    assert result.transfer.blocks_skipped == 3 and result.transfer.blocks_sent == 1
    assert torch.equal(src_kv, dst_kv)
    assert got == colocated.generate([prompt], GREEDY)[0].token_ids


def test_full_hit_on_the_receiver_moves_nothing_but_still_lands(pair, colocated):
    prompt = random_prompts([32], vocab=512, seed=14)[0]
    _disaggregated(pair, prompt, "c0")
    got, result, _, _ = _disaggregated(pair, prompt, "c1")  # both blocks cached in decode
    assert result.transfer.blocks_sent == 0 and result.transfer.blocks_skipped == 2
    assert got == colocated.generate([prompt], GREEDY)[0].token_ids


def test_seeded_sampling_continues_across_the_hand_over(pair, colocated):
    params = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    got, result, _, _ = _disaggregated(pair, PROMPTS[2], "d", params)
    assert result.transfer is not None
    assert got == colocated.generate([PROMPTS[2]], params)[0].token_ids


def test_layout_mismatch_is_refused_before_any_byte_moves(pair):
    prefill = pair[0]
    other = DecodeServer(EngineConfig(model="tiny", num_blocks=64, block_size=8,
                                      show_progress=False), prefill.info.backend, NoPrefill(), disaggregation=ALWAYS)

    async def main():
        dest = await other.reserve(PROMPTS[1], GREEDY, "e", timeout_s=5)
        req = PrefillRequest(tuple(PROMPTS[1]), GREEDY, dest, other.endpoint.info())
        with pytest.raises(RuntimeError, match="LayoutMismatchError.*block_size: local 16 != peer 8"):
            await asyncio.to_thread(prefill.call, "prefill", req, 0)
        _assert_idle(prefill)
        other.abort("e")
        await until_idle(other)

    try:
        asyncio.run(main())
    finally:
        other.close()


def test_deadline_expiry_fails_and_releases(pair, monkeypatch):
    """The lease fails at its deadline; no call runs here, so its blocks are fenced for the
    longest a sender keeps a write past it (shortened here), then released."""
    import kvtransfer.endpoint as kv_endpoint

    monkeypatch.setattr(kv_endpoint, "DRAIN_MAX_S", 0.2)
    decode = pair[2]
    fresh = random_prompts([40], vocab=512, seed=13)[0]  # nothing of it is cached

    async def main():
        dest = await decode.reserve(fresh, GREEDY, "f", timeout_s=0.3)
        assert decode.held_blocks == len(dest.block_ids) > 0
        t = await asyncio.wait_for(decode.landed("f"), 5)
        assert t.state is TransferState.FAILED and "deadline" in t.error
        decode.abort("f")
        await until_idle(decode)

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_killed_prefill_replica_is_replaced_by_a_local_prefill(backend, colocated):
    """The prefill replica dies before it pushes: the request completes by a local prefill at
    once (not at the lease's deadline), with the offline tokens, and nothing stays leased."""
    prefill = Peer("prefill", CONFIG, backend)
    decode = DecodeServer(CONFIG, backend, PeerPrefillHandle(prefill, delay=30), 20.0, disaggregation=ALWAYS)

    async def main():
        sink = TokenSink()
        task = asyncio.ensure_future(generate(decode, sink, PROMPTS[3], "g", GREEDY))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        prefill.kill()
        tokens, result = await asyncio.wait_for(task, 30)
        assert time.monotonic() - t0 < 10 and result.transfer is None
        assert tokens == colocated.generate([PROMPTS[3]], GREEDY)[0].token_ids
        await until_idle(decode)
        await sink.close()

    try:
        asyncio.run(main())
    finally:
        prefill.stop()
        decode.close()


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_killed_decode_peer_fails_the_push_and_releases(backend):
    from prefill_worker.server import PrefillServer

    decode = Peer("decode", CONFIG, backend)
    prefill = PrefillServer(CONFIG, backend)

    async def main():
        # Reach the peer once, so the link exists, then lose it.
        dest = decode.call("reserve", PROMPTS[0], GREEDY, "h0", 5)
        await prefill.prefill(PrefillRequest(tuple(PROMPTS[0]), GREEDY, dest, decode.info))
        dest = decode.call("reserve", PROMPTS[3], GREEDY, "h1", 2)
        decode.kill()
        t0 = time.monotonic()
        try:
            await prefill.prefill(PrefillRequest(tuple(PROMPTS[3]), GREEDY, dest, decode.info))
        except TransferError:
            pass  # the write failed, or its deadline passed
        assert time.monotonic() - t0 < 10
        await until_idle(prefill)

    try:
        asyncio.run(main())
    finally:
        decode.stop()
        prefill.close()


def test_the_readme_kv_transfer_example_runs_as_written():
    """The README's "KV transfer" example, verbatim, in a fresh interpreter: it hands its prompt
    over NIXL (DRAM) and prints the hand-over's summary, and ends without a traceback."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    section = text[text.index("## KV transfer"):]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PYTHONPATH": str(root), "UCX_NET_DEVICES": "lo"}
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "TransferSummary(bytes=" in run.stdout and "blocks_sent=0" not in run.stdout, out[-2000:]
    assert "backend='nixl'" in run.stdout
    assert "Traceback" not in out, out[-3000:]
