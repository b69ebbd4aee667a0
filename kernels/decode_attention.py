"""Paged decode attention in one launch, the engine's for every decode step (a batch's, a
draft's, the verification rows of speculative decoding) but the long steps of a few rows: one
query token a row over the engine's paged cache, the KV of each (row, KV head) split into chunks
by the row's length where rows are few, the partial results merged by the chunk's last program
to finish, no second kernel.

Why not FlashInfer's decode kernel here: under CUDA graphs it always splits the KV into chunks
of at least 128 tokens and merges them in a kernel of its own, and a chunk's loop takes a few
tokens a turn; at batch 1 a layer's attention cost ~9 us on an H100 (split + merge,
docs/benchmarks.md) for ~1 us of bytes. Here a chunk runs 64 tokens a turn on the tensor cores,
a row short enough for one chunk writes its output directly, and under programmatic dependent
launch (``kernels._triton``) each program reads its first page ids before it waits for the
kernel before (the K/V store). With more rows, fewer splits (none past 16 rows at 8 KV heads:
:func:`max_splits`), and the kernel read the KV as fast as FlashInfer's decode kernels or
faster at 16-256 rows (bf16: even to 14% faster; an FP8 cache: 62-89% of the read rate against
FlashInfer's 38-75%, the cache widened to float16 in one instruction where bf16 takes several:
docs/benchmarks.md).

Program ``(row, kv head, split)``: ``tiles`` = the row's tokens in tiles (64 tokens up to
``MAX_ROWS`` rows; :func:`launch_config` beyond); a split takes
``chunk = max(MIN_CHUNK_TILES, ceil(tiles / max_splits))`` tiles (so the number of splits, and the
order of every sum, depends only on the row's length and on ``max_splits``, fixed by the
launch's padded row count: an eager step and the graph it would replay sum alike). Programs past
the row's splits return at once. With one split the program writes the output; otherwise each
writes its normalised partial output and log-sum-exp, counts itself in the (row, head) counter,
and the last to arrive merges the partials in split order, writes the output and sets the
counter back to zero for the next launch (graph-safe). Softmax in base 2 and float32; an FP8
cache's K and V are widened to float16 (exact), the query rounded to float16 (exact for a bf16
query within float16's range; clamped to it), the scales folded into the scores and the
output. The reference is the torch attention backend.
"""

from __future__ import annotations

import math

import torch

from kernels._triton import pdl, tl, triton, wait_for_inputs

MAX_ROWS = 8  # the few-row launch (graph sizes 1, 2, 4, 8); long steps of these: FlashInfer
TILE_TOKENS = 64  # tokens a loop turn
MIN_CHUNK_TILES = 2  # a split takes at least this many tiles (128 tokens)
TARGET_PROGRAMS = 256  # splits per (row, head) so that rows x heads x splits is about this
NUM_WARPS, NUM_STAGES = 8, 2
# Launches of more rows: (tile tokens, warps, stages) up to a row count, by cache, measured at
# 16:8 and 32:8 heads (40:8 and 64:8 for bf16 too), 768 and 2,048 tokens on an H100
# (docs/benchmarks.md, "Baton's decode attention at every batch"); bf16 at 9-48 rows from the
# later grid over 16-64 rows and all four head ratios (the same H100, and an H200).
MANY_ROWS = {"fp8": ((64, (128, 8, 2)), (1 << 30, (64, 4, 3))),
             "bf16": ((48, (64, 4, 3)), (64, (128, 4, 3)), (1 << 30, (64, 4, 3)))}


def max_splits(rows: int, kv_heads: int) -> int:
    """Splits allowed a (row, KV head) at ``rows`` rows, from the row count rounded up to a
    power of two (the graph sizes), so an eager step of 3 rows splits as the 4-row graph."""
    padded = 1 << max(rows - 1, 0).bit_length()
    return max(1, 1 << int(math.log2(max(1, TARGET_PROGRAMS // (padded * kv_heads)))))


def launch_config(rows: int, fp8: bool) -> tuple[int, int, int]:
    """(tokens a loop turn, warps, stages) of a launch over ``rows`` rows of a cache (FP8 or
    16-bit)."""
    if rows <= MAX_ROWS:
        return TILE_TOKENS, NUM_WARPS, NUM_STAGES
    return next(config for top, config in MANY_ROWS["fp8" if fp8 else "bf16"] if rows <= top)


if triton is not None:
    @triton.jit
    def _tile_pages(indices_ptr, first, num_pages, t, j, PAGE: tl.constexpr,
                    TILE_PAGES: tl.constexpr):
        """Page ids of tile ``t``'s tokens ``j`` (0 past the row's pages)."""
        pg = t * TILE_PAGES + j // PAGE
        return tl.load(indices_ptr + first + pg, mask=pg < num_pages, other=0).to(tl.int64)

    @triton.jit
    def _decode_attention_kernel(
            q_ptr, kv_ptr, indptr_ptr, indices_ptr, last_ptr, out_ptr, part_ptr, lse_ptr,
            count_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_kv,
            stride_head, stride_slot, qk_scale, v_scale,
            KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
            MIN_CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr,
            F16: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        TILE: tl.constexpr = PAGE * TILE_PAGES
        # The page table is copied in before the step's first kernel: readable before the wait.
        first = tl.load(indptr_ptr + row)
        num_pages = tl.load(indptr_ptr + row + 1) - first
        tiles = tl.cdiv(num_pages, TILE_PAGES)
        chunk = tl.maximum(MIN_CHUNK, tl.cdiv(tiles, MAX_SPLITS))
        splits = tl.cdiv(tiles, chunk)
        if s < splits:
            ctx = (num_pages - 1) * PAGE + tl.load(last_ptr + row)
            t0 = s * chunk
            t1 = tl.minimum(t0 + chunk, tiles)
            j = tl.arange(0, TILE)
            d = tl.arange(0, HEAD_DIM)
            g = tl.arange(0, GROUP_PAD)
            gmask = g < GROUP
            head = kv_ptr + h * stride_head + (j % PAGE)[:, None] * stride_slot + d[None, :]
            page = _tile_pages(indices_ptr, first, num_pages, t0, j, PAGE, TILE_PAGES)
            wait_for_inputs(PDL)  # q and the newest K/V are the kernel before's
            q = tl.load(q_ptr + row * stride_qt + (h * GROUP + g)[:, None] * stride_qh
                        + d[None, :], mask=gmask[:, None], other=0.0)
            if F16:  # an FP8 cache: e4m3 widens to float16 in one instruction
                q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
            lsum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
            acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
            for t in range(t0, t1):
                # Slots past the row's length are not read (a stale or never-written slot may
                # hold a NaN, which a zero weight would not cancel).
                live = t * TILE + j < ctx
                ptrs = head + page[:, None] * stride_page
                k = tl.load(ptrs, mask=live[:, None], other=0.0).to(q.dtype)
                v = tl.load(ptrs + stride_kv, mask=live[:, None], other=0.0).to(q.dtype)
                page = _tile_pages(indices_ptr, first, num_pages, t + 1, j, PAGE, TILE_PAGES)
                scores = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units
                scores = tl.where(live[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(scores - m_new[:, None])
                lsum = lsum * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
                m = m_new
            o_ptrs = out_ptr + row * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
            if splits == 1:
                tl.store(o_ptrs, (acc * (v_scale / lsum)[:, None]).to(out_ptr.dtype.element_ty),
                         mask=gmask[:, None])
            else:
                base = (row * KV_HEADS + h) * MAX_SPLITS
                tl.store(part_ptr + ((base + s) * GROUP_PAD + g)[:, None] * HEAD_DIM + d[None, :],
                         acc / lsum[:, None], mask=gmask[:, None])
                tl.store(lse_ptr + (base + s) * GROUP_PAD + g, m + tl.log2(lsum))
                tl.debug_barrier()  # every thread's partials written before the count
                counter = count_ptr + row * KV_HEADS + h
                if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                    top = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
                    total = tl.zeros((GROUP_PAD,), dtype=tl.float32)
                    merged = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
                    for i in range(0, splits):
                        lse = tl.load(lse_ptr + (base + i) * GROUP_PAD + g, cache_modifier=".cg")
                        part = tl.load(part_ptr + ((base + i) * GROUP_PAD + g)[:, None] * HEAD_DIM
                                       + d[None, :], mask=gmask[:, None], other=0.0,
                                       cache_modifier=".cg")
                        top_new = tl.maximum(top, lse)
                        alpha = tl.exp2(top - top_new)
                        w = tl.exp2(lse - top_new)
                        total = total * alpha + w
                        merged = merged * alpha[:, None] + w[:, None] * part
                        top = top_new
                    tl.store(o_ptrs, (merged * (v_scale / total)[:, None]).to(
                        out_ptr.dtype.element_ty), mask=gmask[:, None])
                    tl.atomic_xchg(counter, 0)


class DecodeAttention:
    """The kernel's buffers for up to ``rows`` rows: the page table (``pages`` may be shared by
    several instances: one CUDA graph's plan is copied in after the graph before it has run),
    the partials and the counters. :meth:`plan` copies a step's page table in on the stream (no
    host wait); :meth:`run` launches the kernel over a layer's cache."""

    def __init__(self, rows: int, pages: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, scale: float):
        device = pages.device
        self.rows, self.pages, self.block_size = rows, pages, block_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.group_pad = max(16, triton.next_power_of_2(self.group))  # tl.dot takes 16 rows
        self.qk_scale = scale * math.log2(math.e)
        self.indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.last = torch.zeros(rows, dtype=torch.int32, device=device)
        # Room for the most partials any row count up to ``rows`` writes (row slots x splits;
        # none where a row is never split: its program writes the output itself).
        parts = max((n * s for n in range(1, rows + 1) if (s := max_splits(n, num_kv_heads)) > 1),
                    default=1)
        parts *= num_kv_heads * self.group_pad
        self.partials = torch.empty(parts * head_dim, dtype=torch.float32, device=device)
        self.lse = torch.empty(parts, dtype=torch.float32, device=device)
        self.counters = torch.zeros(rows * num_kv_heads, dtype=torch.int32, device=device)
        self.config: tuple[int, int, int] | None = None  # launch_config's, unless set (tools)

    def bind(self, indptr: torch.Tensor, last: torch.Tensor, pages: torch.Tensor) -> None:
        """Read the page table from these int32 buffers (``rows + 1``, ``rows`` and at least the
        pages of a plan) instead of its own, which a caller fills itself (before a CUDA graph
        is captured over them: ``engine.cuda_graph.DecodeGraphs`` copies a step's inputs and
        page table in one copy)."""
        if len(indptr) != self.rows + 1 or len(last) != self.rows:
            raise ValueError(f"DecodeAttention.bind: {len(indptr)} / {len(last)} entries for "
                             f"{self.rows} rows")
        self.indptr, self.last, self.pages = indptr, last, pages

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor) -> None:
        """A step's page table (host int32, FlashInfer's description) for ``n <= rows`` rows."""
        n = len(kv_last_page_len)
        if n > self.rows or len(kv_indices) > len(self.pages):
            raise ValueError(f"DecodeAttention: {n} rows / {len(kv_indices)} pages exceed the "
                             f"buffers ({self.rows} / {len(self.pages)})")
        self.indptr[: n + 1].copy_(kv_indptr, non_blocking=True)
        self.last[:n].copy_(kv_last_page_len, non_blocking=True)
        self.pages[: len(kv_indices)].copy_(kv_indices, non_blocking=True)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, k_scale: float = 1.0,
            v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` ``[n, heads, head_dim]`` (n the planned rows) over one layer's cache
        ``[pages, 2, kv heads, page size, head dim]`` (any strides but the last)."""
        n = q.shape[0]
        out = torch.empty_like(q) if out is None else out
        fp8 = kv_cache.dtype.itemsize == 1
        splits = max_splits(n, self.num_kv_heads)
        tile, warps, stages = self.config or launch_config(n, fp8)
        _decode_attention_kernel[(n, self.num_kv_heads, splits)](
            q, kv_cache, self.indptr, self.pages, self.last, out, self.partials, self.lse,
            self.counters, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            self.qk_scale * (k_scale if fp8 else 1.0), v_scale if fp8 else 1.0,
            KV_HEADS=self.num_kv_heads, GROUP=self.group, GROUP_PAD=self.group_pad,
            HEAD_DIM=self.head_dim, PAGE=self.block_size,
            TILE_PAGES=max(1, tile // self.block_size), MIN_CHUNK=MIN_CHUNK_TILES,
            MAX_SPLITS=splits, F16=fp8, num_warps=warps,
            num_stages=stages, **pdl(q))
        return out
