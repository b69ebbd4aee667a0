"""Prefill in a child process pushes KV into a decode engine in this process, over NIXL (host
memory over UCX) and gloo (the CPU stand-in for NCCL)."""

import time

import pytest
import torch

from decode_worker.core import DecodeCore
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer import TransferState
from benchmarks.engine_peers import Peer, finish
from tests.models import random_prompts

CONFIG = EngineConfig(model="tiny", num_blocks=256)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts([5, 16, 37, 64], vocab=512, seed=11)


@pytest.fixture(scope="module")
def colocated():
    return LLM("tiny")


@pytest.fixture(scope="module", params=["nixl", "nccl"])
def pair(request):
    prefill = Peer("prefill", CONFIG, request.param)
    decode = DecodeCore(CONFIG, request.param)
    yield prefill, decode
    prefill.stop()
    decode.close()


def _disaggregated(prefill, decode, prompt, params=GREEDY, timeout=30):
    dest = decode.begin(prompt, params, timeout_s=timeout)
    result, src_kv = prefill.call("prefill", prompt, params, dest, decode.info(), 0)
    first = decode.complete(result)
    dst_kv = decode.endpoint.kv_cache[:, list(dest.block_ids)].clone()
    return finish(decode.engine, first), result, src_kv, dst_kv


def _assert_idle(decode):
    assert decode.held_blocks == 0
    assert decode.engine.pool.num_used_blocks == 0


def test_blocks_arrive_byte_identical_and_decode_matches_colocated(pair, colocated):
    prefill, decode = pair
    expected = [o.token_ids for o in colocated.generate(PROMPTS, GREEDY)]
    for prompt, tokens in zip(PROMPTS, expected):
        out, result, src_kv, dst_kv = _disaggregated(prefill, decode, prompt)
        assert torch.equal(src_kv, dst_kv)
        assert result.stats.blocks_sent == -(-len(prompt) // 16)
        assert result.stats.bytes == src_kv.numel() * src_kv.element_size()
        assert out.token_ids == tokens
    _assert_idle(decode)
    assert prefill.call("gauges") == (0, 0)


def test_only_missing_blocks_move_when_receiver_holds_a_prefix(pair, colocated):
    prefill, decode = pair
    shared = random_prompts([48], vocab=512, seed=12)[0]
    # The decode engine serves the shared prefix itself first, so its cache holds 3 blocks.
    decode.engine.add_request(shared, GREEDY)
    while decode.engine.has_unfinished_requests():
        decode.engine.step()
    prompt = shared + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    out, result, src_kv, dst_kv = _disaggregated(prefill, decode, prompt)
    assert result.stats.blocks_skipped == 3 and result.stats.blocks_sent == 1
    assert torch.equal(src_kv, dst_kv)
    assert out.token_ids == colocated.generate([prompt], GREEDY)[0].token_ids
    _assert_idle(decode)


def test_full_hit_on_the_receiver_moves_nothing_but_still_lands(pair, colocated):
    prefill, decode = pair
    prompt = random_prompts([32], vocab=512, seed=14)[0]
    _disaggregated(prefill, decode, prompt)
    out, result, _, _ = _disaggregated(prefill, decode, prompt)  # both blocks cached in decode
    assert result.stats.blocks_sent == 0 and result.stats.blocks_skipped == 2
    assert out.token_ids == colocated.generate([prompt], GREEDY)[0].token_ids
    _assert_idle(decode)


def test_seeded_sampling_continues_across_the_hand_over(pair, colocated):
    prefill, decode = pair
    params = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    out, *_ = _disaggregated(prefill, decode, PROMPTS[2], params)
    assert out.token_ids == colocated.generate([PROMPTS[2]], params)[0].token_ids


def test_layout_mismatch_is_refused_before_any_byte_moves(pair):
    prefill, _ = pair
    backend = prefill.info.backend
    other = DecodeCore(EngineConfig(model="tiny", num_blocks=64, block_size=8), backend)
    try:
        dest = other.begin(PROMPTS[1], GREEDY, timeout_s=5)
        with pytest.raises(RuntimeError, match="LayoutMismatchError.*block_size: local 16 != peer 8"):
            prefill.call("prefill", PROMPTS[1], GREEDY, dest, other.info(), 0)
        assert prefill.call("gauges") == (0, 0)
        other.abort(dest.request_id)
        assert other.held_blocks == 0 and other.engine.pool.num_used_blocks == 0
    finally:
        other.close()


def test_deadline_expiry_fails_and_releases(pair):
    _, decode = pair
    fresh = random_prompts([40], vocab=512, seed=13)[0]  # nothing of it is cached
    dest = decode.begin(fresh, GREEDY, timeout_s=0.3)
    assert decode.held_blocks == len(dest.block_ids) > 0
    t = decode._transfers[dest.request_id]
    assert decode.endpoint.wait(t, timeout=5) is TransferState.FAILED
    assert "deadline" in t.error
    _assert_idle(decode)


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_killed_prefill_peer_fails_within_deadline(backend):
    prefill = Peer("prefill", CONFIG, backend)
    decode = DecodeCore(CONFIG, backend)
    try:
        dest = decode.begin(PROMPTS[3], GREEDY, timeout_s=3)
        prefill.send("prefill", PROMPTS[3], GREEDY, dest, decode.info(), 30)
        time.sleep(0.5)
        prefill.kill()
        t0 = time.time()
        assert decode.endpoint.wait(decode._transfers[dest.request_id]) is TransferState.FAILED
        assert time.time() - t0 < 4
        _assert_idle(decode)
    finally:
        prefill.stop()
        decode.close()


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_killed_decode_peer_fails_the_push_and_releases(backend):
    from prefill_worker.core import PrefillCore
    from kvtransfer import TransferError

    decode = Peer("decode", CONFIG, backend)
    prefill = PrefillCore(CONFIG, backend)
    try:
        # Reach the peer once, so the link exists, then lose it.
        dest = decode.call("begin", PROMPTS[0], GREEDY, 5)
        prefill.prefill(PROMPTS[0], GREEDY, dest, decode.info)
        dest = decode.call("begin", PROMPTS[3], GREEDY, 2)
        decode.kill()
        t0 = time.time()
        try:
            prefill.prefill(PROMPTS[3], GREEDY, dest, decode.info)
        except TransferError:
            pass  # the write failed, or its deadline passed
        assert time.time() - t0 < 10
        assert prefill.endpoint.held_blocks == 0
        assert prefill.engine.pool.num_used_blocks == 0
    finally:
        decode.stop()
        prefill.close()
