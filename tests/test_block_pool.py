"""Block pool: reference counts, LRU eviction of cached blocks, chained hashes."""

import pytest

from engine.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocksError, hash_block, hash_blocks


def test_allocate_and_free_with_ref_counts():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4  # the null block is never handed out
    a = pool.allocate(3)
    assert NULL_BLOCK not in a and pool.num_free_blocks == 1
    pool.touch(a[:1])
    assert pool.blocks[a[0]].ref_cnt == 2
    pool.free(a[::-1])
    assert pool.blocks[a[0]].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free(a[:1])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(a[:1])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)


def test_freed_cached_blocks_stay_hits_until_reused_in_lru_order():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    hashes = [hash_block(None, [i] * 4) for i in range(4)]
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])  # freed in this order
    for h, b in zip(hashes, blocks):
        assert pool.match_prefix([h]) == [b]  # still hits while free
    # Reuse evicts least recently freed first: blocks[2], then blocks[0].
    first = pool.allocate(2)
    assert first == [blocks[2], blocks[0]]
    assert pool.match_prefix([hashes[2]]) == [] and pool.match_prefix([hashes[0]]) == []
    assert pool.match_prefix([hashes[3]]) == [blocks[3]]


def test_touching_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 42)
    pool.free([b])
    assert pool.num_blocks_to_touch([b]) == 1
    pool.touch([b])
    assert pool.num_free_blocks == 1 and pool.blocks[b].ref_cnt == 1
    assert pool.allocate(1) != [b]


def test_uncached_free_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(4)
    cached, plain = pool.allocate(2)
    pool.cache_block(cached, 7)
    pool.free([cached])
    pool.free([plain])
    assert pool.allocate(1) == [plain]
    assert pool.match_prefix([7]) == [cached]


def test_match_prefix_stops_at_first_miss_and_respects_disable():
    pool = BlockPool(6)
    hs = hash_blocks(list(range(12)), 4)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], hs[0])
    pool.cache_block(blocks[2], hs[2])
    assert pool.match_prefix(hs) == [blocks[0]]
    off = BlockPool(6, enable_prefix_caching=False)
    b = off.allocate(1)[0]
    off.cache_block(b, hs[0])
    assert off.match_prefix(hs) == []


def test_hashes_are_chained():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different parent
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # partial blocks are not hashed
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, parent=a[0], start_block=1) == a[1:]


def test_hash_blocks_chains_hash_block_from_any_block():
    tokens = list(range(1000, 1000 + 16 * 9 + 5))
    chained, parent = [], None
    for b in range(9):
        parent = hash_block(parent, tokens[16 * b:16 * (b + 1)])
        chained.append(parent)
    assert hash_blocks(tokens, 16) == chained
    assert hash_blocks(tokens, 16, parent=chained[3], start_block=4) == chained[4:]
    assert hash_blocks(tokens, 16, parent=chained[-1], start_block=9) == []


def test_reset_prefix_cache_forgets_free_blocks_only():
    pool = BlockPool(8)
    held, free = pool.allocate(2), pool.allocate(2)
    for b, h in zip(held + free, (11, 12, 13, 14)):
        pool.cache_block(b, h)
    pool.free(free)
    assert pool.match_prefix([13, 14]) == free
    assert pool.reset_prefix_cache() == 2
    assert pool.match_prefix([13, 14]) == [] and pool.match_prefix([11, 12]) == held
