"""The host-memory KV tier (``kv_offloading_size``, engine/kv_offload.py) on the CPU: its LRU and
bound; prompts that return after their blocks left the device pool are served from it with the
greedy tokens of an engine without it (and of one that never evicted them); an FP8 cache through
it; an abort after a host hit leaves nothing held; a hand-over reservation counts host hits as
present, so only the rest is transferred, and through the role servers (1P1D) a prompt the
decode replica's host tier holds moves no KV."""

import pytest

from engine import LLM, SamplingParams
from engine.kv_offload import HostTier
from tests.models import VOCAB, random_prompts

BLOCK_BYTES = 16384  # tiny, float32, block size 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_host_tier_keeps_the_most_recent_blocks_within_its_bound():
    tier = HostTier(3)
    assert [tier.put(h) for h in (10, 11, 12)] == [0, 1, 2]
    assert tier.put(11) is None  # held: now the most recent
    assert tier.put(13) == 0  # the least recent (10) goes
    assert 10 not in tier and tier.match([11, 12, 13]) == [1, 2, 0]
    assert tier.match([12, 99, 13]) == [2]  # a leading run only
    tier.take([12])  # a prompt reads it: not overwritten until released
    assert tier.put(14) == 1 and tier.put(15) == 0  # 11 and 13 go, 12 stays
    tier.take([14, 15])
    assert tier.put(16) is None  # every block is being read: nothing to give
    tier.release()
    assert tier.put(16) == 2 and tier.evicted_blocks == 4  # 10, 11, 13, then 12
    assert tier.clear() == 3 and tier.match([14]) == []


def _llm(**kw) -> LLM:
    return LLM("tiny", show_progress=False, seed=0, **kw)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_returning_prompt_is_served_from_the_host_tier_with_the_same_tokens(kv):
    """A 64-token prompt, then enough others to push its blocks out of a 16-block device
    pool, then the prompt again: its four blocks come back from the host tier (no compute),
    and every answer equals an engine's without the tier."""
    first, *others = random_prompts([64, 80, 80, 80], seed=5)
    size = 64 * BLOCK_BYTES / 2**30
    tiered = _llm(num_blocks=16, kv_offloading_size=size, kv_cache_dtype=kv)
    plain = _llm(num_blocks=16, kv_cache_dtype=kv)
    runs = []
    for llm in (tiered, plain):
        out = _tokens(llm, [first])
        out += _tokens(llm, others)  # one at a time would keep some; together they evict
        again = llm.generate([first], GREEDY)[0]
        runs.append((out + [again.token_ids], again.num_cached_tokens))
    tier = tiered.engine.host_tier
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] == 0 and runs[0][1] == 64  # its four blocks, from the host
    assert tier.hit_blocks >= 3 and tier.loaded_blocks >= 3 and tier.stored_blocks >= 4


def returning_after_evictions(make_llm, k: int, block_bytes: int, vocab: int):
    """Eight prompts of ``k`` full blocks (and five tokens) one at a time, then the last two
    again, a new one, and the sixth again, on an engine whose device pool holds three such
    prompts and whose host tier holds two; and on an engine without the tier and with room for
    all (``make_llm(**config)`` makes each). By the new prompt, the tier has dropped the sixth's
    written-through copies, so its device blocks are copied out again as the new prompt takes
    them, in the step that overwrites them. The sixth then returns from the host tier, and
    every answer must equal the reference's: bit for bit, since both run the same computations
    on the same KV, one request at a time. Returns the tiered engine."""
    prompts = random_prompts([16 * k + 5] * 9, vocab=vocab, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tiered = make_llm(num_blocks=3 * (k + 2),
                      kv_offloading_size=(2 * k + 0.5) * block_bytes / 2**30)
    tier = tiered.engine.host_tier
    assert tier.num_blocks == 2 * k
    got = [tiered.generate([prompts[i]], params)[0] for i in [*range(8), 7, 6]]
    stored = tier.stored_blocks
    got.append(tiered.generate([prompts[8]], params)[0])
    assert tier.stored_blocks - stored > k + 4  # its own blocks, and most of the sixth's again
    loaded = tier.loaded_blocks
    got.append(tiered.generate([prompts[5]], params)[0])
    assert got[-1].num_cached_tokens == 16 * k and tier.loaded_blocks - loaded > k - 2
    reference = make_llm(num_blocks=16 * (k + 2))
    want = [reference.generate([prompts[i]], params)[0].token_ids
            for i in [*range(8), 7, 6, 8, 5]]
    assert [c.token_ids for c in got] == want
    assert tiered.engine.pool.num_used_blocks == 0
    return tiered.engine


def test_blocks_the_tier_dropped_are_copied_out_in_the_step_that_overwrites_them():
    """The sequence :func:`returning_after_evictions` runs: on the CPU every copy is done
    when it is queued; on a GPU (tests/test_gpu_kv_offload.py) the copy out runs on a side
    stream while the step that takes the blocks is queued on the main one."""
    returning_after_evictions(_llm, 8, BLOCK_BYTES, VOCAB)


def test_the_tier_bound_holds_and_a_prompt_beyond_it_is_computed():
    tiered = _llm(num_blocks=16, kv_offloading_size=2 * BLOCK_BYTES / 2**30)
    first, *others = random_prompts([64, 80, 80, 80], seed=6)
    _tokens(tiered, [first])
    _tokens(tiered, others)
    tier = tiered.engine.host_tier
    assert tier.num_blocks == 2 and tier.num_used_blocks <= 2
    assert tiered.generate([first], GREEDY)[0].num_cached_tokens <= 32


def test_an_abort_after_a_host_hit_leaves_nothing_held():
    tiered = _llm(num_blocks=16, kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    engine = tiered.engine
    first, *others = random_prompts([64, 80, 80, 80], seed=7)
    _tokens(tiered, [first])
    _tokens(tiered, others)
    loaded = engine.host_tier.loaded_blocks
    rid = engine.add_request(first, GREEDY)
    engine.step()  # scheduled: the host blocks copied in, the rest prefilled
    assert engine.host_tier.loaded_blocks > loaded
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_used_blocks == 0 and not engine.kv_manager.copies
    assert not engine.scheduler.loading


def _copying(landed: set[int]):
    """A scheduler over a 10-block pool and a 16-block host tier whose copies land when the
    test says so (``landed``: the copy ids that have)."""
    from engine.block_pool import BlockPool
    from engine.kv_cache_manager import KVCacheManager
    from engine.scheduler import Scheduler
    kv = KVCacheManager(BlockPool(11), 4, HostTier(16), copies_done=landed.__contains__)
    return kv, Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=128)


def _prefilled(sched, *seqs):
    """Schedule ``seqs``' prompts in one step, account it, and finish them (blocks cached)."""
    from engine.sequence import FinishReason
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    sched.advance(batch)
    for seq in batch.seqs:
        sched.finish(seq, FinishReason.STOP)
    return batch


def _seq(rid, tokens):
    from engine.sequence import Sequence
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def test_blocks_are_written_through_and_a_step_overwriting_them_waits_for_the_copy():
    kv, sched = _copying(set())
    _prefilled(sched, _seq("a", range(8)))  # two full blocks, copied out as they are written
    out = kv.drain_copies()
    assert out.to_host == [(1, 0), (2, 1)] and out.out_id == 0 and not out.waits
    _prefilled(sched, _seq("b", range(100, 140)))  # ten blocks: a's two are handed out again
    copies = kv.drain_copies()
    assert copies.waits == [out.out_id]  # that step waits for their copy out
    assert len(copies.to_host) == 10  # b's blocks, written through (a's are not copied again)


def test_a_block_the_tier_dropped_after_its_write_through_is_copied_out_when_evicted():
    """A prompt's blocks written through, then pushed out of a small tier by later prompts: when
    its device blocks are handed out, they are copied out again (the tier is told what leaves
    the device), not taken for held by their old, landed copy."""
    from engine.block_pool import BlockPool
    from engine.kv_cache_manager import KVCacheManager
    from engine.scheduler import Scheduler
    kv = KVCacheManager(BlockPool(11), 4, HostTier(2), copies_done=lambda _id: True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=128)
    _prefilled(sched, _seq("a", range(8)))
    a_blocks = [d for d, _ in kv.drain_copies().to_host]
    _prefilled(sched, _seq("b", range(50, 58)))  # the tier's two blocks now hold b's
    kv.drain_copies()
    _prefilled(sched, _seq("c", range(100, 140)))  # ten blocks: a's and b's leave the device
    copies = kv.drain_copies()  # a's copied out first, as they are handed over
    assert sorted(d for d, _ in copies.to_host[:2]) == sorted(a_blocks)


def test_a_prompt_waits_in_loading_for_its_copies_in_while_others_step():
    from engine.sequence import FinishReason
    landed: set[int] = set()
    kv, sched = _copying(landed)
    _prefilled(sched, _seq("a", range(8)))
    _prefilled(sched, _seq("b", range(100, 140)))  # a's blocks leave the device
    kv.drain_copies()
    a2, a3 = _seq("a2", [*range(8), 1, 2, 3, 4]), _seq("a3", [*range(8), 5, 6, 7, 8])
    c = _seq("c", range(200, 208))
    for seq in (c, a2, a3):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [c]  # a2 found a's blocks on the host, a3 found them in a2's blocks
    assert set(sched.loading) == {"a2", "a3"} and a2.kv_load == a3.kv_load
    copies = kv.drain_copies()
    assert len(copies.to_device) == 2 and copies.in_id == a2.kv_load
    sched.advance(batch)
    sched.finish(c, FinishReason.STOP)
    assert not sched.schedule().seqs  # not landed: a2 and a3 still wait, holding their slots
    assert set(sched.loading) == {"a2", "a3"} and sched.num_slots_taken == 2
    assert sched.has_unfinished()
    landed.add(copies.in_id)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a2", "a3"] and not sched.loading
    assert batch.num_new_tokens[-2:] == [4, 4] and a2.num_computed_tokens == 8
    assert kv.drain_copies().waits == [copies.in_id]  # that step waits on the device too


def test_an_aborted_load_frees_its_blocks_and_their_next_writer_waits_for_the_copy():
    from engine.sequence import FinishReason
    kv, sched = _copying(set())
    _prefilled(sched, _seq("a", range(8)))
    _prefilled(sched, _seq("b", range(100, 140)))
    kv.drain_copies()
    a2 = _seq("a2", [*range(8), 1, 2, 3, 4])
    sched.add(a2)
    sched.schedule()
    load = kv.drain_copies().in_id
    sched.finish(a2, FinishReason.ABORT)
    assert kv.pool.num_used_blocks == 0 and not sched.loading and not sched.has_unfinished()
    _prefilled(sched, _seq("d", range(300, 340)))  # every block, a2's loaded ones too
    assert load in kv.drain_copies().waits


def test_a_reservation_counts_host_hits_as_present():
    """The decode role: a prompt whose leading blocks the host tier holds reserves blocks for
    the rest only (the hand-over moves less)."""
    tiered = _llm(num_blocks=16, kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    engine = tiered.engine
    first, *others = random_prompts([64, 80, 80, 80], seed=8)
    _tokens(tiered, [first])
    _tokens(tiered, others)
    prompt = first + [7] * 16
    rid, blocks, present = engine.reserve(prompt, GREEDY)
    assert present == 64 and len(blocks) == 1  # four blocks from the host, one to transfer
    engine.abort_request(rid)
    assert engine.pool.num_used_blocks == 0


@pytest.mark.slow  # worker processes
def test_the_tier_over_two_ranks_gives_the_tokens_of_one():
    """Tensor parallelism: each rank keeps its slice of the same host blocks (the size is the
    total, as vLLM's), the copies run on every rank before the step they precede, and a
    reservation waits for every rank's copies out. A returning prompt over two ranks gets the
    tokens of one rank without the tier, its blocks from the host."""
    from tests.models import model_path

    path = str(model_path("tiny"))
    first, *others = random_prompts([64, 80, 80, 80], seed=5)
    want = _tokens(LLM(path, show_progress=False, num_blocks=16), [first, *others, first])
    split = LLM(path, show_progress=False, num_blocks=16, tensor_parallel_size=2,
                kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    try:
        engine = split.engine
        assert engine.host_tier.num_blocks == 64  # 64 blocks, each rank half of each
        got = _tokens(split, [first]) + _tokens(split, others)
        again = split.generate([first], GREEDY)[0]
        assert got + [again.token_ids] == want
        assert again.num_cached_tokens == 64 and engine.host_tier.loaded_blocks >= 4
        _tokens(split, others)  # out to the host again
        rid, blocks, present = engine.reserve(first + [7] * 16, GREEDY)
        assert present == 64 and len(blocks) == 1
        engine.abort_request(rid)
        assert engine.pool.num_used_blocks == 0
    finally:
        split.engine.shutdown()


def test_the_tier_shows_in_the_engine_snapshot():
    from engine.snapshot import snapshot_of
    tiered = _llm(num_blocks=16, kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    first, *others = random_prompts([64, 80, 80, 80], seed=9)
    _tokens(tiered, [first])
    _tokens(tiered, others)
    _tokens(tiered, [first])
    snap = snapshot_of(tiered.engine)
    assert snap.host_blocks_used + snap.host_blocks_free == 64
    assert snap.host_hit_blocks >= 4 and snap.host_bytes_to_device >= 4 * BLOCK_BYTES
    assert snap.host_bytes_to_host >= snap.host_bytes_to_device
    # the copies' own time and bytes each way (their rate): every copy has landed on the CPU
    assert snap.host_timed_bytes_to_host == snap.host_bytes_to_host
    assert snap.host_timed_bytes_to_device == snap.host_bytes_to_device
    assert snap.host_seconds_to_host > 0 and snap.host_seconds_to_device > 0
    assert snapshot_of(_llm(num_blocks=16).engine).host_blocks_used == 0


@pytest.mark.parametrize("think", [None, 0.01], ids=["turns-at-once", "own-times"])
def test_the_multiturn_benchmark_runs_both_ways(tmp_path, think):
    import json

    from benchmarks import multiturn_bench
    out = tmp_path / "multiturn.json"
    argv = ["--conversations", "3", "--turns", "3", "--system", "32", "--turn-tokens", "32",
            "--output", "4", "--num-blocks", "16", "--host-gb", str(64 * BLOCK_BYTES / 2**30),
            "--json", str(out)]
    if think is not None:
        argv += ["--think-s", str(think), "--stagger-s", "0.01"]
    multiturn_bench.main(argv)
    rows = json.loads(out.read_text())["rows"]
    assert [r["host_gb"] > 0 for r in rows] == [True, False]
    assert rows[0]["host_hit_blocks"] > 0 and rows[0]["returning_ttft_ms"]["p50"] > 0
    assert rows[0]["prefix_hit_rate"] > rows[1]["prefix_hit_rate"]


def test_a_prompt_the_decode_replicas_host_tier_holds_moves_no_kv():
    """1P1D through the role servers as they ship (the local transport): a prompt returning
    after other prompts pushed its blocks out of the decode replica's device cache is found in
    that replica's host tier, so the hand-over moves none of its blocks, with the same tokens."""
    from decode_worker.placement import ALWAYS
    from decode_worker.server import DecodeServer
    from engine import EngineConfig
    from kvtransfer.backends.local import LocalFabric
    from prefill_worker.server import PrefillServer
    from tests.roles import PrefillHandle, run_to_idle

    fabric = LocalFabric()
    prefill = PrefillServer(EngineConfig(model="tiny", num_blocks=128, show_progress=False),
                            "local", fabric=fabric)
    decode = DecodeServer(EngineConfig(model="tiny", num_blocks=16, show_progress=False,
                                       kv_offloading_size=64 * BLOCK_BYTES / 2**30),
                          "local", PrefillHandle(prefill), fabric=fabric, disaggregation=ALWAYS)
    returning, *others = random_prompts([32, 80, 80, 80], seed=31)

    try:
        first, result = run_to_idle(prefill, decode, returning, "first", GREEDY)
        assert result.transfer.blocks_sent == 2
        for i, prompt in enumerate(others):  # 15 blocks: the device cache holds 16
            run_to_idle(prefill, decode, prompt, f"other{i}", GREEDY)
        tier = decode.aengine.engine.host_tier
        loaded = tier.loaded_blocks
        again, result = run_to_idle(prefill, decode, returning, "again", GREEDY)
        assert result.transfer.blocks_sent == 0 and result.transfer.blocks_skipped == 2
        assert tier.loaded_blocks == loaded + 2  # both came back from the host tier
        assert again == first == _tokens(_llm(), [returning])[0]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.e2e
def test_the_multiturn_benchmark_runs_served_1p1d(tmp_path):
    """``multiturn_bench --served 1p1d`` (its own Ray and app, in a process of its own): four
    conversations whose histories outgrow the decode replica's 16 device blocks, with the tier
    on both roles and without, under the app's default placement (``auto``) with a threshold
    below a first turn's 112 tokens and above a returning turn's 52 new ones: the first turns
    are handed over, and a returning turn whose history the decode replica holds (on its GPU or
    in its tier) is prefilled there. The decode replica's tier serves returning turns (how many
    blocks the hand-overs then move, and how many turns stay, depends on how the turns
    interleave: the deterministic case is the role-server test above)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "served.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.multiturn_bench", "--served", "1p1d",
         "--conversations", "4", "--turns", "3", "--system", "64", "--turn-tokens", "48",
         "--output", "4", "--num-blocks", "16", "--host-gb", str(64 * BLOCK_BYTES / 2**30),
         "--think-s", "0.05", "--stagger-s", "0.05", "--disaggregation-mode", "auto",
         "--max-local-prefill-length", "80", "--json", str(out)],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with_tier, without = json.loads(out.read_text())["rows"]
    assert with_tier["errors"] == without["errors"] == []
    assert with_tier["kv_blocks_moved"] > 0 and without["kv_blocks_moved"] > 0
    assert with_tier["tiers"]["DecodeServer"]["host_hit_blocks"] > 0
    assert without["tiers"]["DecodeServer"]["host_hit_blocks"] == 0
    assert with_tier["returning_ttft_ms"]["p50"] > 0
    for row in (with_tier, without):  # every returning turn placed, somewhere
        assert row["returning_turns"] == 8
        assert sum(row["returning_prefilled"].values()) == 8
        assert set(row["returning_prefilled"]) <= {"local", "remote"}
    assert with_tier["returning_prefilled"].get("local", 0) > 0
