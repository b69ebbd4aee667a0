"""The KV-cache manager's verbs (match, allocate, grow, free, commit) on a small pool, and the
scheduler's request index."""

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence

BS = 4


def _seq(rid: str, n: int = 10) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=4))


def test_allocate_commit_match_grow_free():
    kv = KVCacheManager(BlockPool(8), BS)  # 7 usable blocks
    a = _seq("a")
    hit = kv.match(a)
    assert hit.blocks == [] and hit.num_tokens == 0
    assert kv.allocate(a, hit, 10) and len(a.block_ids) == 3 and kv.num_free_blocks == 4
    assert kv.uncommitted([a]) == set(a.block_hashes)  # two full prompt blocks, not cached yet
    a.num_computed_tokens = 10
    kv.commit(a)
    assert a.num_registered_blocks == 2 and kv.uncommitted([a]) == set()
    b = _seq("b")
    hit = kv.match(b)  # the same prompt: its two full blocks are hits
    assert hit.blocks == a.block_ids[:2] and hit.num_tokens == 8
    assert kv.allocate(b, hit, 10) and b.block_ids[:2] == a.block_ids[:2]
    assert kv.num_free_blocks == 3 and b.num_cached_tokens == 8
    assert kv.grow(b, 16) and len(b.block_ids) == 4  # one block more
    assert not kv.grow(b, 16 + 3 * BS) and len(b.block_ids) == 4  # short: nothing taken
    assert not kv.fits_at_all(8 * BS) and kv.fits_at_all(7 * BS)
    kv.free(b)
    kv.free(a)
    assert kv.num_free_blocks == 7 and kv.num_releases == 2
    assert kv.match(_seq("c")).num_tokens == 8  # freed full blocks stay hits


def test_allocate_takes_nothing_when_short():
    kv = KVCacheManager(BlockPool(3), BS)  # 2 usable blocks
    a = _seq("a", 12)
    assert not kv.allocate(a, kv.match(a), 12)
    assert a.block_ids == [] and kv.num_free_blocks == 2


def test_the_scheduler_finds_every_unfinished_request_by_id():
    sched = Scheduler(KVCacheManager(BlockPool(16), BS), max_num_seqs=4,
                      max_num_batched_tokens=64)
    waiting, running, arriving = _seq("w"), _seq("r"), _seq("t")
    sched.add(running)
    sched.schedule()
    sched.add(waiting)
    assert sched.reserve(arriving)
    assert [sched.find(r) for r in "wrt"] == [waiting, running, arriving]
    for seq in (waiting, running, arriving):
        sched.finish(seq, FinishReason.ABORT)
    assert [sched.find(r) for r in "wrt"] == [None] * 3 and sched.requests == {}
    assert sched.kv.num_free_blocks == 15
