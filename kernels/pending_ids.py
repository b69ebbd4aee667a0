"""A decode step's pending input ids taken from the running step's sampled ids, in one launch.

The engine runs one step ahead: a decoding sequence's input is the token the step still running
samples, which lives only on the device when the next step is queued. Row ``r``'s pending row
``src[r]`` (``-1``: the id the host wrote stays) names that token in ``tokens``. As one small
kernel it can sit at the head of a decode CUDA graph that reads ``tokens`` from the graph's own
static buffer of sampled ids (:class:`engine.cuda_graph.DecodeGraphs`), where torch's
``where``/``index`` would be four launches.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton, use_triton


def take_pending_reference(ids: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    ids.copy_(torch.where(src >= 0, tokens[src.clamp(min=0)], ids))


if triton is not None:
    @triton.jit
    def _take_pending_kernel(ids_ptr, src_ptr, tokens_ptr, n, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        src = tl.load(src_ptr + r, mask=r < n, other=-1)
        pending = src >= 0
        tl.store(ids_ptr + r, tl.load(tokens_ptr + src, mask=pending, other=0), mask=pending)


def take_pending(ids: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """``ids[r] = tokens[src[r]]`` where ``src[r] >= 0`` (int64 ``[n]`` each, ``ids`` and
    ``src`` contiguous), in place."""
    if not use_triton(ids) or ids.stride(0) != 1 or src.stride(0) != 1:
        take_pending_reference(ids, src, tokens)
        return
    n = ids.shape[0]
    _take_pending_kernel[(1,)](ids, src, tokens, n, BLOCK=max(16, triton.next_power_of_2(n)),
                               num_warps=1)
