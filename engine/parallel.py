"""Tensor parallelism: the rank's place in its group and the collectives the model calls.

An engine with ``tensor_parallel_size`` = N runs N ranks: rank 0 is the engine (scheduler,
block tables, sampling, outputs) and drives ranks 1..N-1, worker processes that each hold a
slice of the model (:mod:`engine.tp_ranks`). Every rank runs every step on the same inputs;
the model splits its work by heads and columns:

- ``qkv_proj`` and ``gate_up_proj`` are column-parallel (each rank computes its heads' q/k/v and
  its slice of the intermediate size), ``o_proj`` and ``down_proj`` row-parallel (each rank a
  partial sum over its slice, then :func:`all_reduce`);
- the embedding and the LM head are vocabulary-parallel (each rank its rows of the vocabulary:
  the embedding masks ids outside them and all-reduces; the LM head's logits are gathered);
- attention runs each rank's heads over its own KV cache, which holds only its KV heads.

Qwen3 has 8 KV heads at every size, so N ∈ {1, 2, 4, 8} never replicates a KV head; a size that
does not divide the heads (or the vocabulary) is refused by :func:`split`. Each engine has a
process group of its own (gloo on CPU, NCCL on CUDA), made from a file store in the engine's
temporary folder, never the process's default ``torch.distributed`` group: several engines of
several ranks can live in one process (a prefill and a decode engine in a test, say). A model
takes its group when it is built (inside :func:`building`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    pg: object = field(default=None, compare=False, repr=False)  # the process group (size > 1)


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
    """Join the group of ``size`` ranks (every rank calls this, rank 0 included);
    ``init_method`` is ``file://<path>``, a file store only this engine's ranks share."""
    if size == 1:
        return TPGroup()
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.FileStore(init_method.removeprefix("file://"), size)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    return TPGroup(rank, size, pg)


def destroy_tp(group: TPGroup | None, timeout_s: float = 10.0) -> bool:
    """Leave the group (its communicators end with it); returns whether that ended within
    ``timeout_s``. Every rank aborts its communicator at the same time (rank 0 as it tells the
    others to stop): NCCL's abort waits for the other ranks of the node to abort too, and its
    graceful shutdown also waits for work captured in CUDA graphs, which never completes
    (pytorch/pytorch#115388). Seen on two H100s: rank 0 closing after its worker had been
    stopped waited forever. The wait is bounded, so a rank that died (and will never abort)
    costs ``timeout_s`` and leaves the communicator to the process's exit."""
    if group is None or group.size == 1:
        return True

    def end() -> None:
        for way in ("abort", "shutdown"):  # gloo may lack abort
            try:
                getattr(group.pg, way)()
                return
            except Exception:  # noqa: BLE001 - best effort at shutdown
                continue

    import threading

    thread = threading.Thread(target=end, name="baton-tp-abort", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


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
        group.pg.allreduce([x]).wait()
    return x


def broadcast(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (the sampled tokens the next step reads)."""
    if group.size > 1:
        group.pg.broadcast([x], _broadcast_options()).wait()
    return x


def all_gather_last(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension (the vocabulary of logits)."""
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    group.pg.allgather([parts], [x.contiguous()]).wait()
    return torch.cat(parts, dim=-1)


def _broadcast_options():
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts
