"""Per-step attention metadata, set by the model runner so model code takes only (ids, positions)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from engine.block_pool import NULL_BLOCK


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto sequences and KV blocks.

    Tokens of sequence ``i`` are ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch; they
    sit at the last ``query_lens[i]`` positions of a context of ``context_lens[i]`` tokens whose KV
    lives in the pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` (the last one holding
    ``kv_last_page_len[i]`` tokens): FlashInfer's paged description, kept on the host for
    planning. ``slot_mapping[t]`` is where token ``t``'s K/V is stored
    (``block * block_size + offset``), or -1 where it must not be stored (padding, or KV already
    present from the prefix cache).
    """

    slot_mapping: torch.Tensor | None  # [num_tokens] int64, device (set by the runner)
    query_start_loc: list[int]  # host, len num_seqs + 1
    context_lens: list[int]  # host
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32, host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, host
    kv_last_page_len: torch.Tensor  # [num_seqs] int32, host
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


def null_meta(num_seqs: int, q_len: int, block_size: int) -> AttentionMetadata:
    """Sequences of ``q_len`` new tokens whose whole context lies in the null block (warm-up and
    CUDA-graph padding): attention reads zeros. The caller sets the slot mapping (all -1, so
    nothing is stored)."""
    pages = -(-q_len // block_size)
    i32 = torch.int32
    return AttentionMetadata(
        slot_mapping=None, query_start_loc=[i * q_len for i in range(num_seqs + 1)],
        context_lens=[q_len] * num_seqs,
        kv_indptr=torch.arange(0, (num_seqs + 1) * pages, pages, dtype=i32)[: num_seqs + 1],
        kv_indices=torch.full((num_seqs * pages,), NULL_BLOCK, dtype=i32),
        kv_last_page_len=torch.full((num_seqs,), q_len - (pages - 1) * block_size, dtype=i32),
        block_size=block_size, is_decode_only=q_len == 1)


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
