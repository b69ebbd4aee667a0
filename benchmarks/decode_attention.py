"""Paged decode attention for small batches in one launch: split-KV with the merge done by the
last program of each (sequence, KV head).

Program ``(b, h, s)`` takes the ``s``-th of ``SPLITS`` equal runs of sequence ``b``'s pages for
KV head ``h`` and its ``GROUP`` query heads, keeps an online softmax over them, and writes the
partial output and log-sum-exp to a workspace. It then bumps a counter for ``(b, h)``; the
program that finds it at ``SPLITS - 1`` merges the partials, writes the output and resets the
counter (so the next launch, or a CUDA-graph replay, starts from zero). One launch instead of a
decode kernel and a merge kernel; the grid depends only on the batch size, so it is graph-safe.

The cache is one layer's ``[pages, 2, kv heads, page size, head dim]`` with any strides (the
engine's block-major layout); pages are given as FlashInfer's ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len`` on the device. The reference is the torch attention backend.

Measured against FlashInfer by ``benchmarks/decode_split_bench.py`` and not faster, so the engine
does not use it (``docs/benchmarks.md``); it lives here, with the benchmark.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

SPLITS = 16
PAGES_PER_ITER = 4  # pages loaded per loop turn (64 tokens at page size 16)

def decode_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                               kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One query token per sequence, float32 softmax; page tables on the host."""
    page = kv_cache.shape[3]
    group = q.shape[1] // kv_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].to(kv_cache.device).long()
        ctx = (len(pages) - 1) * page + int(kv_last_page_len[b])
        kv = kv_cache[pages].float()  # [pages, 2, kv heads, page, dim]
        k = kv[:, 0].transpose(0, 1).reshape(kv.shape[2], -1, kv.shape[-1])[:, :ctx]
        v = kv[:, 1].transpose(0, 1).reshape(kv.shape[2], -1, kv.shape[-1])[:, :ctx]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        probs = torch.softmax((q[b].float()[:, None, :] * k).sum(-1) * scale, dim=-1)
        out[b] = (probs[:, :, None] * v).sum(1).to(q.dtype)
    return out


if triton is not None:
    @triton.jit
    def _decode_attention_kernel(
            q_ptr, kv_ptr, indptr_ptr, indices_ptr, last_ptr, out_ptr, part_o_ptr, part_lse_ptr,
            count_ptr, stride_qt, stride_qh, stride_kp, stride_kkv, stride_kh, stride_ks,
            stride_ot, stride_oh, num_kv_heads, scale,
            PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
            GROUP_PAD: tl.constexpr, SPLITS: tl.constexpr, PAGES_PER_ITER: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        first = tl.load(indptr_ptr + b)
        num_pages = tl.load(indptr_ptr + b + 1) - first
        ctx = (num_pages - 1) * PAGE + tl.load(last_ptr + b)
        per_split = tl.cdiv(num_pages, SPLITS)
        p0 = s * per_split
        p1 = tl.minimum(p0 + per_split, num_pages)

        g = tl.arange(0, GROUP_PAD)
        gmask = g < GROUP
        d = tl.arange(0, HEAD_DIM)
        TILE: tl.constexpr = PAGE * PAGES_PER_ITER
        j = tl.arange(0, TILE)  # token within the tile: page j // PAGE, slot j % PAGE
        q = tl.load(q_ptr + b * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        lsum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
        head = kv_ptr + h * stride_kh
        for p in range(p0, p1, PAGES_PER_ITER):
            pg = p + j // PAGE
            live = pg < p1
            page = tl.load(indices_ptr + first + pg, mask=live, other=0).to(tl.int64)
            ptrs = head + page[:, None] * stride_kp + (j % PAGE)[:, None] * stride_ks + d[None, :]
            k = tl.load(ptrs, mask=live[:, None], other=0.0)  # [TILE, HEAD_DIM]
            v = tl.load(ptrs + stride_kkv, mask=live[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, TILE], fp32
            valid = live & (pg * PAGE + j % PAGE < ctx)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            w = tl.exp(scores - m_new[:, None])
            lsum = lsum * alpha + tl.sum(w, axis=1)
            acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v)
            m = m_new

        row = (b * num_kv_heads + h) * SPLITS + s
        has = p1 > p0
        lse = tl.where(has, m + tl.log(lsum), float("-inf"))
        o = tl.where(has, acc / tl.where(has, lsum, 1.0)[:, None], 0.0)
        tl.store(part_o_ptr + (row * GROUP_PAD + g)[:, None] * HEAD_DIM + d[None, :], o)
        tl.store(part_lse_ptr + row * GROUP_PAD + g, lse)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + b * num_kv_heads + h, 1, sem="acq_rel")
        if done == SPLITS - 1:
            tl.debug_barrier()
            rows = (b * num_kv_heads + h) * SPLITS + tl.arange(0, SPLITS)
            lses = tl.load(part_lse_ptr + rows[:, None] * GROUP_PAD + g[None, :],
                           cache_modifier=".cg")  # [SPLITS, GROUP_PAD]
            top = tl.max(lses, axis=0)
            wts = tl.where(lses == float("-inf"), 0.0, tl.exp(lses - top[None, :]))
            total = tl.sum(wts, axis=0)
            merged = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
            for i in range(SPLITS):
                r = (b * num_kv_heads + h) * SPLITS + i
                wi = tl.load(part_lse_ptr + r * GROUP_PAD + g, cache_modifier=".cg")
                wi = tl.where(wi == float("-inf"), 0.0, tl.exp(wi - top))
                oi = tl.load(part_o_ptr + (r * GROUP_PAD + g)[:, None] * HEAD_DIM + d[None, :],
                             cache_modifier=".cg")
                merged += wi[:, None] * oi
            merged = merged / total[:, None]
            tl.store(out_ptr + b * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                     merged.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
            tl.atomic_xchg(count_ptr + b * num_kv_heads + h, 0)


class DecodeAttention:
    """Fixed buffers for up to ``max_batch`` sequences (one per CUDA graph size): page tables,
    the partials' workspace and the counters. ``plan`` copies a step's page tables in (no host
    sync); ``run`` launches the kernel."""

    def __init__(self, max_batch: int, max_pages: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, scale: float, device: torch.device):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.scale, self.max_batch = block_size, scale, max_batch
        self.group = num_heads // num_kv_heads
        self.group_pad = max(16, triton.next_power_of_2(self.group))  # tl.dot needs 16 rows

        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=device)
        self.indptr, self.indices, self.last = i32(max_batch + 1), i32(max_pages), i32(max_batch)
        rows = max_batch * num_kv_heads * SPLITS
        self.part_o = torch.empty(rows * self.group_pad * head_dim, dtype=torch.float32,
                                  device=device)
        self.part_lse = torch.empty(rows * self.group_pad, dtype=torch.float32, device=device)
        self.counts = i32(max_batch * num_kv_heads)
        self.batch = 0

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor) -> None:
        """Host int32 page tables of ``batch <= max_batch`` sequences."""
        self.batch = len(kv_last_page_len)
        self.indptr[: self.batch + 1].copy_(kv_indptr, non_blocking=True)
        self.indices[: len(kv_indices)].copy_(kv_indices, non_blocking=True)
        self.last[: self.batch].copy_(kv_last_page_len, non_blocking=True)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``q``: ``[batch, heads, head dim]``; ``kv_cache``: one layer's paged cache."""
        out = torch.empty_like(q)
        _decode_attention_kernel[(self.batch, self.num_kv_heads, SPLITS)](
            q, kv_cache, self.indptr, self.indices, self.last, out, self.part_o, self.part_lse,
            self.counts, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), kv_cache.stride(3), out.stride(0), out.stride(1),
            self.num_kv_heads, self.scale, PAGE=self.block_size, HEAD_DIM=self.head_dim,
            GROUP=self.group, GROUP_PAD=self.group_pad, SPLITS=SPLITS,
            PAGES_PER_ITER=PAGES_PER_ITER, num_warps=4)
        return out
