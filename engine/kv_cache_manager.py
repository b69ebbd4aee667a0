"""The scheduler's view of the KV cache: which blocks a sequence holds, what the prefix cache
already has, and which full blocks are offered to it. The scheduler decides who runs; this
decides whether their tokens fit and gives them blocks, through five verbs:

- :meth:`match` — the longest cached prefix of a sequence's prompt (nothing taken yet);
- :meth:`allocate` — take that prefix and fresh blocks for a first chunk, or nothing;
- :meth:`grow` — more blocks for a running sequence's next tokens, or nothing;
- :meth:`free` — give a sequence's blocks back (its full blocks stay prefix-cache hits);
- :meth:`commit` — offer the blocks filled with known tokens' KV to the prefix cache.

Blocks live in :class:`engine.block_pool.BlockPool` (reference counts, the hash table, the LRU
free queue); this module is where a sequence's token counts become block counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.block_pool import BlockPool, hash_blocks
from engine.kv_offload import HostTier, KVCopies
from engine.sequence import Sequence


@dataclass(frozen=True)
class PrefixHit:
    blocks: list[int]  # cached block ids of the prompt's leading full blocks
    num_tokens: int  # tokens they hold, and the host tier's blocks (at most the sequence's)
    host_blocks: list[int] = field(default_factory=list)  # the host tier's next blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.host_blocks)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, host: HostTier | None = None,
                 copies_done: Callable[[int], bool] = lambda copy_id: True):
        self.pool = pool
        self.block_size = block_size
        self.num_releases = 0  # sequences whose blocks went back to the pool, ever
        # The host tier (engine.kv_offload) and the copies it asks for, queued until the engine
        # drains them (drain_copies); ``copies_done(id)``: whether a drained batch's copies out
        # (its id) or in (id + 1) have landed.
        self.host = host
        self.copies_done = copies_done
        self.copies = KVCopies(0)
        self.copying_out: dict[int, int] = {}  # device block -> id of the copy out reading it
        self.loading: dict[int, int] = {}  # device block -> id of the copy in writing it
        if host is not None:
            pool.on_evict = self._evicted

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_at_all(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever fit in this cache."""
        return self.blocks_for(num_tokens) <= self.num_usable_blocks

    def cached_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache holds now (nothing taken:
        a probe, for deciding where a prompt is prefilled)."""
        hashes = hash_blocks(token_ids, self.block_size)
        blocks = self.pool.match_prefix(hashes)
        host = self._host_hits(hashes[len(blocks):])
        return min((len(blocks) + len(host)) * self.block_size, len(token_ids))

    # -- the verbs --------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixHit:
        self._update_hashes(seq)
        if seq.params.prompt_logprobs is not None:  # every prompt position is computed
            return PrefixHit([], 0)
        blocks = self.pool.match_prefix(seq.block_hashes)
        host = self._host_hits(seq.block_hashes[len(blocks):])
        return PrefixHit(blocks, min((len(blocks) + len(host)) * self.block_size,
                                     seq.num_tokens), host)

    def allocate(self, seq: Sequence, hit: PrefixHit, num_tokens: int) -> bool:
        """Reference ``hit``'s blocks and allocate the rest of the blocks for ``seq``'s first
        ``num_tokens`` tokens; False (nothing taken) when free blocks are short. The first
        new blocks take the host tier's hits: their copies in are queued, their hashes
        registered (the copies run before any step that reads them)."""
        need = max(self.blocks_for(num_tokens) - len(hit.blocks), 0)
        if need + self.pool.num_blocks_to_touch(hit.blocks) > self.pool.num_free_blocks:
            return False
        self.pool.touch(hit.blocks)
        self.pool.record_lookup(seq.num_tokens, hit.num_tokens)
        loaded = seq.block_hashes[len(hit.blocks):hit.num_blocks]
        if loaded:
            self.host.take(loaded)  # kept until the copies are queued (drain_copies)
        new = self.pool.allocate(need)
        # A step may read these blocks only once the copies writing them have landed: this
        # prompt's own copies in, and those of another prompt's that still fill its hits.
        waits = [copy_id for b in hit.blocks if (copy_id := self._loading(b)) is not None]
        if loaded:
            waits.append(self.copies.in_id)
        for i, (host_block, block_hash) in enumerate(zip(hit.host_blocks, loaded)):
            self.copies.to_device.append((host_block, new[i]))
            self.pool.cache_block(new[i], block_hash)
            self.loading[new[i]] = self.copies.in_id
        seq.kv_load = max(waits, default=None)
        seq.block_ids = hit.blocks + new
        seq.num_draft_computed = 0  # a new block table: the draft's cache holds none of it
        seq.num_present_tokens = hit.num_tokens
        seq.num_cached_tokens = hit.num_tokens
        seq.num_registered_blocks = hit.num_blocks
        return True

    def _host_hits(self, block_hashes: list[int]) -> list[int]:
        """The host tier's blocks for the leading run of ``block_hashes`` (those past the
        device cache's hits)."""
        if self.host is None or not self.pool.enable_prefix_caching:
            return []
        return self.host.match(block_hashes)

    def _loading(self, block_id: int) -> int | None:
        """The id of the copy in still writing ``block_id``, if any."""
        copy_id = self.loading.get(block_id)
        if copy_id is not None and self.landed(copy_id):
            del self.loading[block_id]
            return None
        return copy_id

    def landed(self, copy_id: int) -> bool:
        """Whether copy ``copy_id`` has been queued (drained) and has landed."""
        return copy_id < self.copies.out_id and self.copies_done(copy_id)

    def _evicted(self, block_id: int, block_hash: int) -> None:
        """``block_id`` is handed to other tokens, which the next step writes: after the copy
        out reading it (written through, or queued now if the tier no longer holds it)."""
        self.wait_for(self._loading(block_id))  # an aborted prompt's copy in, still landing
        self.loading.pop(block_id, None)
        copy_id = self.copying_out.pop(block_id, None)
        if copy_id is not None and block_hash not in self.host:  # written through, dropped
            if not self.landed(copy_id):  # by the tier since: copied out again (after that
                self.wait_for(copy_id)  # copy, if it still reads the block)
            copy_id = None
        if copy_id is None:
            host_block = self.host.put(block_hash)
            if host_block is None:
                return
            self.copies.to_host.append((block_id, host_block))
            copy_id = self.copies.out_id
        self.wait_for(copy_id)

    def _write_through(self, block_id: int, block_hash: int) -> None:
        host_block = self.host.put(block_hash)
        if host_block is not None:
            self.copies.to_host.append((block_id, host_block))
            self.copying_out[block_id] = self.copies.out_id

    def wait_for(self, copy_id: int | None) -> None:
        """The next step waits for copy ``copy_id`` (a sequence whose blocks it fills joins
        that step, or the step overwrites the blocks it reads)."""
        if copy_id is not None and copy_id not in self.copies.waits:
            self.copies.waits.append(copy_id)

    def drain_copies(self) -> KVCopies:
        """The copies queued since the last call, for the model runner to queue before the next
        step (which waits for ``waits`` first)."""
        copies = self.copies
        self.copies = KVCopies(copies.out_id + 2)
        if self.host is not None:
            self.host.release()
        return copies

    def forget_copies(self) -> None:
        """Every copy queued has landed (the engine waited for them): nothing to track."""
        self.copying_out.clear()
        self.loading.clear()

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``seq``'s first ``num_tokens`` tokens; False (nothing taken) when free
        blocks are short."""
        extra = self.blocks_for(num_tokens) - len(seq.block_ids)
        if extra > self.pool.num_free_blocks:
            return False
        if extra > 0:
            seq.block_ids += self.pool.allocate(extra)
        return True

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_ids)
        seq.block_ids = []
        self.num_releases += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        """Give blocks back in token order's reverse, so a prompt's last blocks (the least
        shared) are evicted before its first ones."""
        self.pool.free(block_ids[::-1])

    def commit(self, seq: Sequence) -> None:
        """Offer the blocks filled with computed KV of known tokens to the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks or not self.pool.enable_prefix_caching:
            return
        self._update_hashes(seq)
        num_full = min(num_full, len(seq.block_hashes))
        for b in range(seq.num_registered_blocks, num_full):
            if self.pool.cache_block(seq.block_ids[b], seq.block_hashes[b]) \
                    and self.host is not None:
                self._write_through(seq.block_ids[b], seq.block_hashes[b])
        seq.num_registered_blocks = num_full

    def uncommitted(self, seqs: Iterable[Sequence]) -> set[int]:
        """Hashes of full prompt blocks that these sequences are still computing (not yet in
        the prefix cache)."""
        if not self.pool.enable_prefix_caching:
            return set()
        return {h for seq in seqs if seq.num_registered_blocks < len(seq.block_hashes)
                for h in seq.block_hashes[seq.num_registered_blocks:]}

    def _update_hashes(self, seq: Sequence) -> None:
        have = len(seq.block_hashes)
        known = seq.num_resolved_tokens
        if known // self.block_size > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += hash_blocks(seq.token_ids[:known], self.block_size, parent, have)
