"""Per-step attention metadata, set by the model runner so model code takes only (ids, positions)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto sequences and KV blocks.

    Tokens of sequence ``i`` are ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch; they
    sit at the last ``query_lens[i]`` positions of a context of ``context_lens[i]`` tokens whose KV
    lives in the blocks ``block_tables[i]``. ``slot_mapping[t]`` is where token ``t``'s K/V is
    stored (``block * block_size + offset``), or -1 where it must not be stored (padding, or KV
    already present from the prefix cache).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, device (padded with the null block)
    query_start_loc: list[int]  # host, len num_seqs + 1
    context_lens: list[int]  # host
    block_size: int
    is_decode_only: bool = False
    extras: dict = field(default_factory=dict)  # backend-private plan state

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]


_CURRENT: ContextVar[AttentionMetadata | None] = ContextVar("baton_forward_context", default=None)


def get_forward_context() -> AttentionMetadata:
    meta = _CURRENT.get()
    if meta is None:
        raise RuntimeError("attention called outside engine.forward_context.set_forward_context()")
    return meta


@contextmanager
def set_forward_context(meta: AttentionMetadata):
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)
