"""The host-memory tier under the prefix cache (``kv_offloading_size``, vLLM's name: GiB of host
memory; 0 turns it off).

A full block that leaves the device cache (its device block handed to other tokens) is copied to
a host block first, keyed by the same chained prefix hash the device cache uses; a prompt whose
next blocks the device cache lacks but the host tier holds gets fresh device blocks and copies
back instead of computing them. Least recently used host blocks go first when the tier is full.

This module is the bookkeeping only (no tensors): :class:`HostTier` maps hashes to host blocks,
and :class:`engine.kv_cache_manager.KVCacheManager` queues the copies it implies, which the
engine hands to every rank's model runner before the next step is launched
(``Executor.copy_blocks``; with tensor parallelism each rank keeps its slice of every host
block, and the size is the total over the ranks, as vLLM's), on the step's own stream: a copy
out of a device block is queued after the step that wrote it and before any step that writes
it again, and a copy into one before the step that reads it. A
hand-over's reservation, whose blocks another engine writes, waits for its copies out first, on
every rank (``LLMEngine.reserve``). The request router counts host hits
(``router.replica_choice.KVAwareRouter``).

What is not built yet: copies on a side stream overlapped with steps (they run in the step's
stream, in order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.block_pool import leading_run


class HostTier:
    """``num_blocks`` host blocks; ``hash -> host block`` in least-recently-used order."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("kv_offloading_size holds no block")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._pinned: set[int] = set()  # host blocks a queued copy into the device reads
        self.clear()
        self.stored_blocks = 0  # copies device -> host, ever
        self.loaded_blocks = 0  # copies host -> device, ever
        self.evicted_blocks = 0

    @property
    def num_used_blocks(self) -> int:
        return len(self._lru)

    @property
    def hit_blocks(self) -> int:
        """Blocks prompts found here (not on the device): each is copied in, so these are the
        copies host -> device."""
        return self.loaded_blocks

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Host blocks of the leading run of ``block_hashes`` held here (nothing taken)."""
        return leading_run(self._lru, block_hashes)

    def take(self, block_hashes: Sequence[int]) -> None:
        """The prompt of these hashes reads their host blocks: most recently used, and never
        overwritten until :meth:`release` (the copies into the device are queued by then)."""
        for h in block_hashes:
            self._lru.move_to_end(h)
            self._pinned.add(self._lru[h])
        self.loaded_blocks += len(block_hashes)

    def release(self) -> None:
        self._pinned.clear()

    def put(self, block_hash: int) -> int | None:
        """A host block to copy the device block of ``block_hash`` into; None when the tier
        has it already (made most recent) or every host block is being read."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        if self._free:
            block = self._free.pop()
        else:
            victim = next((h for h, b in self._lru.items() if b not in self._pinned), None)
            if victim is None:
                return None
            block = self._lru.pop(victim)
            self.evicted_blocks += 1
        self._lru[block_hash] = block
        self.stored_blocks += 1
        return block

    def clear(self) -> int:
        """Forget every block (``reset_prefix_cache``); returns how many were held."""
        n = len(self._lru)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._lru.clear()
        self._pinned.clear()
        return n
