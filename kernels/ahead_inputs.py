"""The inputs of a draft model's first step of a round, written on the device from a
verification's result before the host has read it (:mod:`engine.draft_model`'s step ahead).

After the target verifies ``k`` proposals of a sequence whose last token was at position ``P``,
with ``n`` of them kept (``n`` only on the device yet), the draft's cache holds the sequence up
to ``P + n`` when ``n < k``: it lacks only the target's own token at ``P + n + 1``, and a step
of that one token gives the next proposal. When every proposal was kept it lacks two, the last
proposal at ``P + k`` and the target's token after it; the step then takes the first of them
(one row either way: a graph of one row a sequence, its one-row kernels). One program writes
every sequence's row of a decode graph in :class:`engine.cuda_graph.StagedInputs`' layout: ids,
positions, slots and pending rows (int64, ``size`` each), then the few-row attention kernel's
page table (int32: indptr, last page lengths, pages), each row reading its sequence's pages up
to and including its position. Rows past the sequences' (the graph's padding) read one page of
the null block and store nothing, as :meth:`engine.cuda_graph.DecodeGraphs._padded_meta` pads.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton
from kernels.decode_attention import MAX_ROWS as ROWS  # rows the kernel is compiled for

PAGE_BLOCK = 256  # pages a loop iteration copies

if triton is not None:
    # One compiled kernel for every step: no specialization on the counts (a sequence's table
    # grows a page at a time, its proposals shrink near its end) and rows for the largest
    # graph on the few-row attention kernel.
    @triton.jit(do_not_specialize=["num_seqs", "size", "table_width", "null_block",
                                   "max_proposals"])
    def _ahead_inputs_kernel(kept_ptr, drawn_ptr, proposed_ptr, seqs_ptr, tables_ptr, rows_ptr,
                             table_ptr, kept_out_ptr, num_seqs, size, table_width, block_size,
                             null_block, max_proposals, ROWS: tl.constexpr,
                             PAGES: tl.constexpr):
        r = tl.arange(0, ROWS)  # a row a sequence, then the padding
        in_graph = r < size
        real = r < num_seqs
        fields = seqs_ptr + r * 3
        row0 = tl.load(fields, mask=real, other=0)
        k = tl.load(fields + 1, mask=real, other=0)
        base = tl.load(fields + 2, mask=real, other=0)
        n = tl.zeros([ROWS], dtype=tl.int64)
        alive = real
        for j in range(0, max_proposals):
            alive = alive & (j < k)
            kept = tl.load(kept_ptr + row0 + j, mask=alive, other=0)
            alive = alive & (kept != 0)
            n += alive.to(tl.int64)
        tl.store(kept_out_ptr + r, n, mask=real)
        some = n < k  # else every proposal was kept: the last one's row
        own = tl.load(drawn_ptr + row0 + n, mask=real & some, other=0)
        last_kept = tl.load(proposed_ptr + row0 + k - 1, mask=real & (n == k), other=0)
        ids = tl.where(real, tl.where(some, own, last_kept), 0)
        pos = tl.where(real, base + tl.where(some, n + 1, k), 0)
        block = tl.load(tables_ptr + r * table_width + pos // block_size, mask=real, other=0)
        slot = tl.where(real, block * block_size + pos % block_size, -1)
        tl.store(rows_ptr + r, ids, mask=in_graph)
        tl.store(rows_ptr + size + r, pos, mask=in_graph)
        tl.store(rows_ptr + 2 * size + r, slot, mask=in_graph)
        tl.store(rows_ptr + 3 * size + r, tl.full([ROWS], -1, tl.int64), mask=in_graph)
        context = pos + 1
        pages = tl.where(in_graph, (context + block_size - 1) // block_size, 0)
        ends = tl.cumsum(pages, 0)
        tl.store(table_ptr + r, tl.zeros([ROWS], dtype=tl.int32), mask=r == 0)
        tl.store(table_ptr + 1 + r, ends.to(tl.int32), mask=in_graph)
        tl.store(table_ptr + size + 1 + r,
                 (context - (pages - 1) * block_size).to(tl.int32), mask=in_graph)
        starts = ends - pages
        out = table_ptr + 2 * size + 1
        for row in tl.static_range(ROWS):
            start = tl.sum(tl.where(r == row, starts, 0))
            count = tl.sum(tl.where(r == row, pages, 0))  # 0 past the graph's rows
            a_seq = tl.sum(tl.where((r == row) & real, 1, 0))  # 1: a sequence's row; 0: padding
            src = tables_ptr + a_seq * row * table_width
            for p0 in range(0, count, PAGES):
                p = p0 + tl.arange(0, PAGES)
                live = p < count
                page = tl.load(src + p, mask=live, other=0) * a_seq + null_block * (1 - a_seq)
                tl.store(out + start + p, page.to(tl.int32), mask=live)


def ahead_inputs(words: torch.Tensor, size: int, kept: torch.Tensor, drawn: torch.Tensor,
                 proposed: torch.Tensor, seqs: torch.Tensor, tables: torch.Tensor,
                 block_size: int, null_block: int, max_proposals: int) -> torch.Tensor:
    """Write the draft step's rows and page table for a graph of ``size`` rows into ``words``
    (int64, :class:`engine.cuda_graph.StagedInputs`' buffer) from the verification's device
    results: ``kept`` (bool, a row per verified token: its proposal was kept), ``drawn`` (the
    target's token at each row), ``proposed`` (the proposal each row checked). ``seqs``:
    int64 ``[B, 3]``, each sequence's first verification row, proposals (at most
    ``max_proposals``) and the position of its last token before the verification;
    ``tables``: int64 ``[B, width]``, each one's blocks, enough for position ``P + k + 1``.
    Returns the proposals kept per sequence (int64 ``[B]``, on the device)."""
    num_seqs = seqs.shape[0]
    if num_seqs > size:
        raise ValueError(f"{num_seqs} sequences take a row each; the graph has {size}")
    kept_out = torch.empty(num_seqs, dtype=torch.int64, device=words.device)
    table = words.view(torch.int32)[8 * size:]
    _ahead_inputs_kernel[(1,)](
        kept, drawn, proposed, seqs, tables, words, table, kept_out, num_seqs, size,
        tables.shape[1], block_size, null_block, max_proposals,
        ROWS=max(ROWS, triton.next_power_of_2(size)), PAGES=PAGE_BLOCK, num_warps=1)
    return kept_out
