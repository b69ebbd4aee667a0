"""KV block pool with prefix caching.

Every block has a reference count. A full block gets a chained hash (xxhash of the parent
block's hash and the block's token ids) and is registered in the prefix cache. A block whose count
falls to zero goes to the tail of an LRU free queue *keeping its hash*: it stays a cache hit until
it is handed out again, at which point its hash is dropped (evicted). Freed blocks without a hash
go to the head of the queue, since they are worth nothing to keep. Block 0 is the null block:
never handed out, it pads block tables.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

NULL_BLOCK = 0


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """xxh3-64 of the parent block's hash (or a root marker) and this block's token ids."""
    return _chained(parent, array("q", token_ids))


def _chained(parent: int | None, packed) -> int:
    """:func:`hash_block` of a block's tokens already packed as int64 (any buffer)."""
    h = xxhash.xxh3_64()
    h.update(b"\x00" * 9 if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(packed)
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: int | None = None,
                start_block: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` from ``start_block`` on."""
    hashes, end = [], len(token_ids) // block_size
    if end <= start_block:
        return hashes
    # One packed copy of the blocks' tokens, hashed a block's slice at a time.
    packed = memoryview(array("q", token_ids[start_block * block_size:end * block_size]))
    for i in range(0, (end - start_block) * block_size, block_size):
        parent = _chained(parent, packed[i:i + block_size])
        hashes.append(parent)
    return hashes


def leading_run(table: dict[int, int], block_hashes: Sequence[int]) -> list[int]:
    """``table``'s values for the leading run of ``block_hashes`` it holds (a prefix lookup)."""
    out = []
    for h in block_hashes:
        value = table.get(h)
        if value is None:
            break
        out.append(value)
    return out


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_cnt = 1  # pinned forever
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Called with (block id, hash) as a cached block is handed out again (its KV about to be
        # overwritten): the host tier's chance to keep a copy (engine.kv_offload).
        self.on_evict = None
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix (not yet referenced: call :meth:`touch`)."""
        return leading_run(self._cached, block_hashes) if self.enable_prefix_caching else []

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under its hash; False (a no-op) if that hash is already
        cached or the block has one."""
        if not self.enable_prefix_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    # -- references -------------------------------------------------------------------------
    def num_blocks_to_touch(self, block_ids: Sequence[int]) -> int:
        """How many free blocks touching ``block_ids`` would take out of the free queue."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self._free[b]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)  # least recently freed first
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict from the prefix cache
                if self.on_evict is not None:
                    self.on_evict(block_id, block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every free block's hash (vLLM's ``reset_prefix_cache``): none of them is a hit
        any more. Blocks in use keep theirs (their requests still own them). Returns how many
        blocks were forgotten."""
        n = 0
        for b in self._free:
            block = self.blocks[b]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                n += 1
        return n

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail first, so that its
        last blocks (the least shared) are evicted before its first ones."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt <= 0 or b == NULL_BLOCK:
                raise RuntimeError(f"block {b} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[b] = None
                if block.block_hash is None:  # no cache value: hand it out first
                    self._free.move_to_end(b, last=False)
