"""FlashInfer attention over the engine's paged cache (CUDA, bf16/fp16 queries; the cache in the
same dtype or in FP8 e4m3, read with the layer's scales).

One step is planned once and shared by all layers: decode-only steps use the batch decode
wrapper, every other step (prefill, chunked prefill, prompts whose first blocks are prefix-cache
hits, mixed prefill and decode) the paged prefill wrapper with a causal mask aligned to the end
of each context. The cache is HND per layer, ``[pages, 2, kv heads, page size, head dim]``, with
a page stride that spans all layers (the engine stores KV block-major); FlashInfer reads the
strides from the tensor.

CUDA graphs: :meth:`graph_decode_wrapper` gives a decode wrapper over fixed index buffers for
one batch size; a graph captured with it replays whatever :meth:`plan_decode` later writes into
those buffers.

Decode steps (graphed or eager) run Baton's one-launch Triton decode attention instead of
FlashInfer's decode and merge kernels (measured faster at every batch: docs/benchmarks.md), but
for the long steps of up to ``kernels.decode_attention.MAX_ROWS`` rows; ``BATON_SMALL_DECODE``
chooses otherwise (:func:`triton_decode_rows`).

Planning while the previous step runs: a plan's page ids are on the device before FlashInfer
sees them (it copies host page ids into a graph wrapper's buffer with a blocking copy, which held
the host until the running step ended; the device then idled while the host finished the plan
and launched the next step), and every other array a plan sends goes from pinned memory, whose
copies are always queued (from pageable memory CUDA may copy synchronously).
A wrapper's plan writes its work split into a pinned host buffer of that wrapper and queues a
copy from it. Before planning a wrapper again, the backend waits for that copy (an event
recorded after each plan), which has normally run already: it was queued behind the step
before, which the engine has waited for.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import flashinfer
import torch
from flashinfer.page import get_seq_lens

from engine.attention.base import AttentionBackend, default_decode_tensor_cores
from engine.forward_context import AttentionMetadata
from engine.uploads import host_tensor, pinned, upload
from kernels import decode_attention

WORKSPACE_BYTES = 256 * 2**20
# Few-row decode steps longer than this (tokens in the longest row) run FlashInfer's kernel:
# at 4,096 tokens the few-row kernel measured 6-7% slower on Qwen3-0.6B (1 and 8 rows), 14B
# and 32B (8 rows), even to 2% faster on 8B; up to 3,072 it was even or faster on 14B and 32B,
# and even at 2,048 on 0.6B (docs/benchmarks.md, "Long contexts back on FlashInfer").
SMALL_DECODE_MAX_CONTEXT = 3072
_EMPTY = torch.empty(0, dtype=torch.int32)
# The int workspace of a lone prompt's graph wrapper (FlashInfer's default is 8 MiB a wrapper):
# its plan for one prompt of up to a few thousand tokens takes a few KiB (FA3's: ~8 arrays of
# a work item per query tile and head; FA2's: a few per tile).
PROMPT_PLAN_BYTES = 2**20


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, device: torch.device, dtype: torch.dtype,
                 decode_tensor_cores: bool | None = None, kv_dtype: torch.dtype | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_dtype or dtype
        self.decode_tensor_cores = (
            default_decode_tensor_cores(num_heads, num_kv_heads, self.kv_dtype.itemsize == 1)
            if decode_tensor_cores is None else decode_tensor_cores)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "HND")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_tensor_cores=self.decode_tensor_cores)
        self.small_decode_rows = triton_decode_rows()
        self._eager_small: decode_attention.DecodeAttention | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        if "wrapper" in meta.extras:  # planned by the CUDA-graph runner
            return
        if meta.is_decode_only:
            self.plan_decode(self._eager_decode(meta), meta)
            return
        with _plan_fence(self.prefill_wrapper):
            self._plan_prefill(self.prefill_wrapper, meta)
        meta.extras["wrapper"] = self.prefill_wrapper

    def _plan_prefill(self, wrapper, meta: AttentionMetadata) -> None:
        indptr, last = pinned(meta.kv_indptr), pinned(meta.kv_last_page_len)
        wrapper.plan(pinned(host_tensor(meta.query_start_loc, torch.int32)), indptr,
                     self._page_ids(meta), last, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.block_size, causal=True, sm_scale=self.scale,
                     q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                     seq_lens=pinned(get_seq_lens(indptr, last, self.block_size)))

    def _eager_decode(self, meta: AttentionMetadata):
        """The eager decode step's wrapper: the small-batch kernel up to its rows (over page
        buffers grown as needed), else FlashInfer's."""
        n = meta.num_seqs
        if n > self.small_decode_rows or self.long_context(meta):
            return self.decode_wrapper
        small = self._eager_small
        if small is None or small.rows < n or len(small.pages) < len(meta.kv_indices):
            pages = torch.zeros(max(len(meta.kv_indices), 1024), dtype=torch.int32,
                                device=self.device)
            rows = max(decode_attention.MAX_ROWS, 1 << (n - 1).bit_length())
            small = self._eager_small = self._small_decode(rows, pages)
        return small

    def _small_decode(self, rows: int, pages: torch.Tensor) -> decode_attention.DecodeAttention:
        return decode_attention.DecodeAttention(rows, pages, self.num_heads, self.num_kv_heads,
                                                self.head_dim, self.block_size, self.scale)

    def plan_decode(self, wrapper, meta: AttentionMetadata) -> None:
        meta.extras["wrapper"] = wrapper
        if isinstance(wrapper, decode_attention.DecodeAttention):
            wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
            return
        if wrapper.is_cuda_graph_enabled and torch.equal(
                getattr(wrapper, "_baton_indptr", _EMPTY), meta.kv_indptr):
            # Same pages per sequence as the last plan: the split of the work is the same, only
            # the page ids and the last pages' fill change, and the kernel reads both from the
            # wrapper's fixed buffers at run time. Skips the host-side plan (~0.1 ms a step).
            wrapper._paged_kv_indices_buf[: len(meta.kv_indices)].copy_(
                pinned(meta.kv_indices), non_blocking=True)
            wrapper._paged_kv_last_page_len_buf.copy_(pinned(meta.kv_last_page_len),
                                                      non_blocking=True)
            return
        with _plan_fence(wrapper):
            wrapper.plan(pinned(meta.kv_indptr), self._page_ids(meta),
                         pinned(meta.kv_last_page_len), self.num_heads, self.num_kv_heads,
                         self.head_dim, self.block_size, sm_scale=self.scale,
                         q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        wrapper._baton_indptr = meta.kv_indptr

    def _page_ids(self, meta: AttentionMetadata) -> torch.Tensor:
        """The step's page ids on the device, their copy queued: FlashInfer copies host page ids
        into a graph wrapper's buffer with a blocking copy, which waits for the running step
        (0.4 ms of idle device a step at 256 rows of 0.6B)."""
        return upload(meta.kv_indices, torch.int32, self.device)

    @property
    def long_context_rows(self) -> int:
        """The most rows a step may have for its long rows to send it to FlashInfer's kernel:
        Baton's few-row launch (``MAX_ROWS``), where it runs them. A step of more rows runs one
        kernel at every length (Baton's, or FlashInfer's where ``BATON_SMALL_DECODE`` says)."""
        return min(self.small_decode_rows, decode_attention.MAX_ROWS)

    def long_context(self, meta: AttentionMetadata) -> bool:
        """Whether a decode step of few rows is too long for the few-row kernel (its longest
        row past ``SMALL_DECODE_MAX_CONTEXT``): FlashInfer's kernel runs it."""
        return (meta.num_seqs <= self.long_context_rows
                and self.long_context_len(max(meta.context_lens)))

    def long_context_len(self, context_len: int) -> bool:
        """:meth:`long_context` of a step whose longest row reads ``context_len`` tokens."""
        return bool(self.long_context_rows) and context_len > SMALL_DECODE_MAX_CONTEXT

    def graph_decode_wrapper(self, batch_size: int, pages: torch.Tensor,
                             long_context: bool = False):
        """``pages``: the block-index buffer (int32), long enough for any batch of this size;
        it may be shared by the wrappers of every size. ``long_context``: the wrapper of this
        size's steps that :meth:`long_context` sends to FlashInfer, or None where the one
        wrapper serves every length."""
        if long_context and batch_size > self.long_context_rows:
            return None  # one kernel takes this size's steps at every length
        if batch_size <= self.small_decode_rows and not long_context:
            return self._small_decode(batch_size, pages)

        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=buf(batch_size + 1), paged_kv_indices_buffer=pages,
            paged_kv_last_page_len_buffer=buf(batch_size))

    def graph_prompt_wrapper(self, meta: AttentionMetadata):
        """A prefill wrapper over fixed buffers, planned now for ``meta``: one prompt of
        ``size`` tokens with nothing before it (``null_meta(1, size, ...)``), the shape a graph
        of a lone prompt's whole step replays (``engine.cuda_graph.MixedGraphs``). Every prompt
        padded to that size has the same plan; only its page ids differ, which the kernel reads
        from the wrapper's buffer when it runs (:meth:`set_prompt_pages`). Its own small int
        workspace holds the plan for the graph's lifetime."""
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, qo_indptr_buf=buf(2),
            paged_kv_indptr_buf=buf(2), paged_kv_indices_buf=buf(len(meta.kv_indices)),
            paged_kv_last_page_len_buf=buf(1))
        wrapper.reset_workspace_buffer(self.workspace, torch.zeros(
            PROMPT_PLAN_BYTES, dtype=torch.uint8, device=self.device))
        self._plan_prefill(wrapper, meta)
        torch.cuda.synchronize(self.device)  # (the plan's copies out of pinned memory)
        return wrapper

    @staticmethod
    def set_prompt_pages(wrapper, pages: torch.Tensor) -> None:
        """Queue the copy of a lone prompt's page ids (host int32, the null block's past its
        own pages) into the buffer a :meth:`graph_prompt_wrapper` reads."""
        wrapper._paged_kv_indices_buf.copy_(pinned(pages), non_blocking=True)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
        wrapper = meta.extras["wrapper"]
        if isinstance(wrapper, decode_attention.DecodeAttention):
            return wrapper.run(q, kv_cache, k_scale, v_scale, out=out)
        if out is None:  # (FlashInfer's prefill zero-fills one first: a kernel a layer)
            out = torch.empty_like(q)
        if kv_cache.dtype == self.dtype:
            return wrapper.run(q, kv_cache, out=out)
        return wrapper.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out)


def triton_decode_rows() -> int:
    """The most rows a decode step runs on Baton's kernel (``kernels.decode_attention``); more go
    to FlashInfer's. Every step by default (but the long ones of up to ``MAX_ROWS`` rows:
    :meth:`FlashInferBackend.long_context`): over an FP8 cache FlashInfer's tensor-core kernel
    read 38-75% of the device's read rate at 16-256 rows and Baton's 62-89%; over a bf16 cache
    Baton's was even or faster at 16-256 rows (16:8 and 32:8 heads), and 8B's and 0.6B's 256
    sequences decoded 1-5% faster (docs/benchmarks.md). ``BATON_SMALL_DECODE``: ``0``
    FlashInfer everywhere, ``few`` Baton's up to ``MAX_ROWS`` rows only (before 2026-11-28;
    A/B runs)."""
    choice = os.environ.get("BATON_SMALL_DECODE", "1")
    if choice == "0":
        return 0
    if choice == "few":
        return decode_attention.MAX_ROWS
    return 1 << 30


@contextmanager
def _plan_fence(wrapper):
    """Wait until the wrapper's last plan has been copied out of its pinned buffer; mark this
    plan's copy."""
    done = getattr(wrapper, "_baton_plan_copied", None)
    if done is None:
        done = wrapper._baton_plan_copied = torch.cuda.Event()
    else:
        done.synchronize()
    yield
    done.record()
