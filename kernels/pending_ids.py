"""A decode step's pending input ids taken from the running step's sampled ids, in one launch.

The engine runs one step ahead: a decoding sequence's input is the token the step still running
samples, which lives only on the device when the next step is queued. Row ``r``'s pending row
``src[r]`` (``-1``: the id the host wrote stays) names that token in ``tokens``. As one small
kernel it can sit at the head of a decode CUDA graph that reads ``tokens`` from the graph's own
static buffer of sampled ids (:class:`engine.cuda_graph.DecodeGraphs`), where torch's
``where``/``index`` would be four launches.

:func:`take_inputs` does that and, first, brings the step's inputs in itself: it reads the words
the host wrote into pinned memory (:class:`engine.cuda_graph.StagedInputs`' layout: ids,
positions, slots and pending rows, int64, ``size`` each, then the page table as int32: indptr,
last page lengths, pages) across the bus, as the graph's first kernel, and writes them into the
graph's device buffer. The copy the host queued before the replay, and the wait between it and
the graph, are gone (an H200, 0.6B at batch 1: a step 12 us shorter on the device,
docs/benchmarks.md). Pinned memory is mapped into the device's address space (unified
addressing), so a kernel reads it through the same pointer.
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


def take_inputs_reference(host: torch.Tensor, dev: torch.Tensor, tokens: torch.Tensor,
                          size: int) -> None:
    n = _words_used(host, size)
    dev[:n].copy_(host[:n])
    rows = dev[:4 * size].view(4, size)
    take_pending_reference(rows[0], rows[3], tokens)


def _words_used(host: torch.Tensor, size: int) -> int:
    """int64 words of a step of ``size`` rows: its rows, then a table of ``indptr[size]`` pages."""
    pages = int(host.view(torch.int32)[9 * size])
    return 4 * size + -(-(2 * size + 1 + pages) // 2)


if triton is not None:
    @triton.jit
    def _take_inputs_kernel(host32_ptr, dev32_ptr, host_ptr, dev_ptr, tokens_ptr, capacity,
                            SIZE: tl.constexpr, SIZE_P2: tl.constexpr, BLOCK: tl.constexpr):
        # The first block of words and the page count in one trip across the bus (``.cv``: read
        # again every replay, never an earlier replay's line from a cache).
        i = tl.arange(0, BLOCK)
        first = tl.load(host32_ptr + i, mask=i < capacity, other=0, cache_modifier=".cv")
        pages = tl.load(host32_ptr + 9 * SIZE, cache_modifier=".cv")
        r = tl.arange(0, SIZE_P2)
        src = tl.load(host_ptr + 3 * SIZE + r, mask=r < SIZE, other=-1, cache_modifier=".cv")
        # int32 words: rows (2 a value), indptr, last lengths, pages; whole int64 words
        n = (10 * SIZE + 2 + pages) // 2 * 2
        tl.store(dev32_ptr + i, first, mask=i < n)
        for start in range(BLOCK, n, BLOCK):  # a long table's other pages
            j = start + i
            tl.store(dev32_ptr + j, tl.load(host32_ptr + j, mask=j < n, cache_modifier=".cv"),
                     mask=j < n)
        pending = src >= 0
        token = tl.load(tokens_ptr + src, mask=pending, other=0)
        tl.debug_barrier()  # the ids copied above, before the pending ones are written over them
        tl.store(dev_ptr + r, token, mask=pending)


def take_inputs(host: torch.Tensor, dev: torch.Tensor, tokens: torch.Tensor, size: int) -> None:
    """Copy a step's words from ``host`` (int64, pinned) into ``dev`` (int64, on the device),
    as many as its rows and page table take, then its pending ids from ``tokens``
    (:func:`take_pending`), in one launch that reads ``host`` itself."""
    if not use_triton(dev):
        take_inputs_reference(host, dev, tokens, size)
        return
    _take_inputs_kernel[(1,)](host.view(torch.int32), dev.view(torch.int32), host, dev, tokens,
                              2 * min(host.numel(), dev.numel()), SIZE=size,
                              SIZE_P2=max(16, triton.next_power_of_2(size)), BLOCK=256,
                              num_warps=4)
