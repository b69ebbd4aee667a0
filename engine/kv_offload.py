"""The host-memory tier under the prefix cache (``kv_offloading_size``, vLLM's name: GiB of host
memory; 0 turns it off).

Every full block the device cache registers is copied to a host block too, keyed by the same
chained prefix hash the device cache uses; a prompt whose next blocks the device cache lacks but
the host tier holds gets fresh device blocks and copies back instead of computing them. Least
recently used host blocks go first when the tier is full.

This module is the bookkeeping only (no tensors): :class:`HostTier` maps hashes to host blocks,
and :class:`engine.kv_cache_manager.KVCacheManager` queues the copies it implies as
:class:`KVCopies`, which the engine hands to every rank's model runner before the next step is
launched (``Executor.copy_blocks``; with tensor parallelism each rank keeps its slice of every
host block, and the size is the total over the ranks, as vLLM's).

The copies run on a side stream of their own, overlapped with the steps (on CUDA; on the CPU
they run as they are queued):

- **Out, as blocks are written** (write-through, as SGLang's HiCache by default and vLLM's CPU
  offloading): a full block is copied to the host once the step that computes it has been
  launched, so a block that later leaves the device cache is already there, and evicting it
  costs nothing. A block the host tier has dropped meanwhile is copied out when its device block
  is handed out again, as before.
- **In, before the prompt runs**: a prompt that finds blocks in the host tier takes device
  blocks for them and waits, holding its slot, until their copy has landed; the scheduler only
  then lets it into a step (``Scheduler.loading``), so other sequences' steps run meanwhile.
  Another prompt that finds those device blocks in the cache waits for the same copy.

Every batch of copies is ordered after the steps launched before it (the side stream waits for
the step stream), and two ids name it, one for its copies out and one for its copies in
(:class:`KVCopies`). A step waits, on the device, for the ids it depends on: the copies in of
the sequences that join it, and the copies out of blocks it is about to overwrite. A hand-over's
reservation, whose blocks another engine writes, waits on the host for every copy queued so far,
on every rank (``LLMEngine.reserve``), and so does ``reset_prefix_cache``. The request router
counts host hits (``router.replica_choice.KVAwareRouter``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_pool import leading_run


@dataclass
class KVCopies:
    """One batch of the host tier's copies, queued before a step: ``out_id`` names its copies
    out (device block, host block), ``out_id + 1`` its copies in (host block, device block);
    ``waits``: the ids the next step waits for."""

    out_id: int
    to_host: list[tuple[int, int]] = field(default_factory=list)
    to_device: list[tuple[int, int]] = field(default_factory=list)
    waits: list[int] = field(default_factory=list)

    @property
    def in_id(self) -> int:
        return self.out_id + 1

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device or self.waits)


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
