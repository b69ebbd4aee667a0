"""Tensor parallelism: the rank's place in its group and the collectives the model calls.

An engine with ``tensor_parallel_size`` = N runs N ranks: rank 0 is the engine (scheduler,
block tables, sampling, outputs) and drives ranks 1..N-1, worker processes that each hold a
slice of the model (:mod:`engine.tp_worker`). Every rank runs every step on the same inputs;
the model splits its work by heads and columns:

- ``qkv_proj`` and ``gate_up_proj`` are column-parallel (each rank computes its heads' q/k/v and
  its slice of the intermediate size), ``o_proj`` and ``down_proj`` row-parallel (each rank a
  partial sum over its slice, then :func:`all_reduce`);
- the embedding and the LM head are vocabulary-parallel (each rank its rows of the vocabulary:
  the embedding masks ids outside them and all-reduces; the LM head's logits are gathered);
- attention runs each rank's heads over its own KV cache, which holds only its KV heads.

Qwen3 has 8 KV heads at every size, so N ∈ {1, 2, 4, 8} never replicates a KV head; a size that
does not divide the heads (or the vocabulary) is refused by :func:`split`. The group is the
process's default ``torch.distributed`` group: gloo on CPU, NCCL on CUDA (one group per
process). A model takes its rank and group size when it is built (inside :func:`building`), so
an engine of one rank and a tensor-parallel one can live in the same process.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_GROUP = TPGroup()


def tp() -> TPGroup:
    """The rank and group size of the model being built (0 and 1 without tensor parallelism)."""
    return _GROUP


@contextmanager
def building(group: TPGroup):
    """Build a model (its layers, its runner, its weights) as ``group``'s rank."""
    global _GROUP
    before, _GROUP = _GROUP, group
    try:
        yield group
    finally:
        _GROUP = before


def init_tp(rank: int, size: int, init_method: str, device: torch.device,
            timeout_s: float = 120.0) -> TPGroup:
    """Join the group of ``size`` ranks (every rank calls this, rank 0 included)."""
    if size > 1:
        from datetime import timedelta

        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, size)


def destroy_tp() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def split(total: int, what: str, size: int | None = None) -> int:
    """This rank's share of ``total`` (heads, columns, vocabulary rows)."""
    size = _GROUP.size if size is None else size
    if total % size:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {what} "
                         f"({total})")
    return total // size


def check_tp(cfg, size: int) -> None:
    """Refuse a group size that does not split the model evenly, before any rank starts."""
    for total, what in ((cfg.num_attention_heads, "attention heads"),
                        (cfg.num_key_value_heads, "KV heads"),
                        (cfg.intermediate_size, "intermediate size"),
                        (cfg.vocab_size, "vocabulary")):
        split(total, what, size)


def all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the group, in place (nothing to do alone)."""
    if group.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def broadcast(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (the sampled tokens the next step reads)."""
    if group.size > 1:
        import torch.distributed as dist

        dist.broadcast(x, 0)
    return x


def all_gather_last(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension (the vocabulary of logits)."""
    if group.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
