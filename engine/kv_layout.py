"""How an engine's paged KV cache sits in memory, as the transfer layer and a peer need to know
it: one type for what the engine owns and what the hand-over checks.

The cache is block-major (blocks, layers, K/V, KV heads, block size, head dim: one block of every
layer is one contiguous region; :class:`engine.model_runner.ModelRunner` allocates it so). With
tensor parallelism each rank holds its slice of the KV heads under the same block ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace

LAYOUT_VERSION = 1  # of the memory layout itself (what ``compat_hash`` covers)
RANK_FIELDS = ("tp_size", "tp_rank")  # a rank's place, not part of the model layout


@dataclass(frozen=True)
class KVLayout:
    """How one rank's KV cache sits in memory. Two endpoints may exchange blocks only when
    their model layouts are equal (``kvtransfer.types.check_compatible``, before any byte
    moves). The tensor a transfer endpoint holds is the view indexed ``[layer, block, ...]``;
    ``dtype`` is the cache's element type (``"bfloat16"``, ``"float8_e4m3fn"``);
    ``num_kv_heads`` is the model's, and with tensor parallelism a rank's cache holds
    ``local_kv_heads`` of them, the ``tp_rank``-th slice of ``tp_size``."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_size: int = 1
    tp_rank: int = 0

    def compat_hash(self) -> str:
        """The model layout's hash (a rank's place is not part of it: ranks of any TP sizes map
        onto each other by heads)."""
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items())
                        if k not in RANK_FIELDS)
        return hashlib.sha256(f"v{LAYOUT_VERSION}|{text}".encode()).hexdigest()[:16]

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def heads(self) -> tuple[int, int]:
        """The model's KV heads this rank holds, ``[start, stop)``."""
        start = self.tp_rank * self.local_kv_heads
        return start, start + self.local_kv_heads

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[self.dtype]

    @property
    def head_bytes(self) -> int:
        """One KV head of one layer's K (or V) in one block."""
        return self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes_per_layer(self) -> int:
        return 2 * self.local_kv_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.block_bytes_per_layer

    def regions(self, runs, side: int, heads=None) -> list[tuple[int, int]]:
        """``(byte offset, length)`` from the cache's start of the contiguous regions that hold
        ``runs`` (``(src_start, dst_start, count)``, :func:`kvtransfer.backends.base.block_runs`;
        side 0: the source blocks, 1: the destination's): one region per run, every layer of
        its blocks. With ``heads`` (``kvtransfer.types.HeadSlice``: each side's first head and
        the count), one region per block, layer and K/V: the heads' part of it."""
        if heads is None:
            return [(run[side] * self.block_bytes, run[2] * self.block_bytes) for run in runs]
        first = heads.src if side == 0 else heads.dst
        length, chunk = heads.count * self.head_bytes, self.local_kv_heads * self.head_bytes
        return [(block * self.block_bytes + part * chunk + first * self.head_bytes, length)
                for run in runs for block in range(run[side], run[side] + run[2])
                for part in range(2 * self.num_layers)]


@dataclass(frozen=True)
class KVCacheSpec:
    """An engine's paged KV cache as a transfer layer needs it (``kvtransfer.endpoint_for``):
    every rank's cache, rank 0's first, each indexed ``[layer, block, K/V, kv head, slot, head
    dim]`` over block-major memory; how another process opens each on a GPU (``handles``: a
    worker rank's own CUDA IPC handle, None for rank 0's, which is shared as it is); and their
    layout (rank 0's: ``tp_size`` ranks, each with ``num_kv_heads / tp_size`` heads)."""

    layout: KVLayout
    caches: tuple
    handles: tuple = ()

    @property
    def kv_cache(self):
        return self.caches[0]

    @property
    def tp_size(self) -> int:
        return len(self.caches)

    def rank_layout(self, rank: int) -> KVLayout:
        return replace(self.layout, tp_rank=rank)
