"""The small-batch decode attention kernel (kernels.decode_attention) against the torch backend:
on the CPU through Triton's interpreter (in a subprocess, float16 and FP8 caches: the
interpreter misreads bfloat16), and on the GPU in bfloat16, eager and replayed in a CUDA graph
on new page tables."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.forward_context import AttentionMetadata
from tests.interpreter import run_interpreted

# (context lengths of the rows, query heads, KV heads, page size, rows the buffers hold, FP8):
# one chunk, several chunks merged, a row of one token, GQA groups of 2, 4, 5 and 8, pages of
# 16 and 32 tokens, one row in 9 splits and FP8 caches with their scales.
CASES = [
    ([1], 16, 8, 16, 1, False),
    ([150], 16, 8, 16, 8, False),
    ([129, 64, 1000, 17], 32, 8, 16, 8, False),
    ([700, 5], 40, 8, 16, 2, False),
    ([100], 64, 8, 32, 1, False),
    ([1100], 16, 8, 16, 1, False),
    ([4000], 16, 8, 16, 1, False),  # 32 splits: merged 8 a load
    ([300, 700], 16, 8, 16, 2, True),
    # more rows than MAX_ROWS: 128-token tiles with rows in 2 splits
    # (kernels.decode_attention.launch_config; more rows, a row a program, on the GPU below)
    ([5 + 37 * i for i in range(12)], 32, 8, 16, 16, True),
]


def page_table(ctxs, page, total, g, device):
    """The rows' pages drawn in a random order from ``total``: their decode metadata (host
    page table, FlashInfer's description)."""
    counts = [-(-c // page) for c in ctxs]
    indices = torch.randperm(total, generator=g)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    last = torch.tensor([c - (n - 1) * page for c, n in zip(ctxs, counts)], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(1, device=device), query_start_loc=list(range(len(ctxs) + 1)),
        context_lens=list(ctxs), kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
        block_size=page, is_decode_only=True)


def paged_case(ctxs, heads, kv_heads, page, dtype, device, fp8=False, seed=0, total=None):
    """A random cache of ``total`` pages (enough for the rows by default), the rows' page table
    and queries."""
    g = torch.Generator().manual_seed(seed)
    total = total or sum(-(-c // page) for c in ctxs) + 4
    cache = torch.randn(total, 2, kv_heads, page, 128, generator=g).to(dtype)
    if fp8:
        cache = cache.float().to(torch.float8_e4m3fn)
    meta = page_table(ctxs, page, total, g, device)
    q = torch.randn(len(ctxs), heads, 128, generator=g).to(dtype)
    return cache.to(device), q.to(device), meta


def reference(q, cache, meta, heads, kv_heads, scales):
    ref = TorchAttentionBackend(heads, kv_heads, 128, 128 ** -0.5, meta.block_size)
    ref.plan(meta)
    return ref.forward(q, cache, meta, *scales)


def check_cases(dtype: torch.dtype, device: str) -> None:
    """Every case: the kernel within rounding of the reference, twice the same bytes (the
    counters back at zero after each launch)."""
    from kernels.decode_attention import DecodeAttention

    for ctxs, heads, kv_heads, page, rows, fp8 in CASES:
        cache, q, meta = paged_case(ctxs, heads, kv_heads, page, dtype, device, fp8)
        scales = (0.5, 1.5) if fp8 else (1.0, 1.0)
        pages = torch.zeros(len(meta.kv_indices) + 8, dtype=torch.int32, device=device)
        dec = DecodeAttention(rows, pages, heads, kv_heads, 128, page, 128 ** -0.5)
        dec.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
        got = dec.run(q, cache, *scales)
        again = dec.run(q, cache, *scales)
        want = reference(q, cache, meta, heads, kv_heads, scales)
        err = (got.float() - want.float()).abs().max().item()
        assert err < 2e-2, (ctxs, heads, fp8, err)
        assert torch.equal(got, again), ctxs
        assert int(dec.counters.abs().sum()) == 0, ctxs


def test_max_splits_follow_the_padded_rows():
    from kernels.decode_attention import max_splits

    # An eager step of n rows splits as the graph of n rounded up to a power of two.
    for kv_heads in (1, 2, 4, 8, 5):
        for n, size in ((3, 4), (5, 8), (6, 8), (7, 8)):
            assert max_splits(n, kv_heads) == max_splits(size, kv_heads)
    assert max_splits(1, 8) == 32 and max_splits(8, 8) == 4 and max_splits(64, 8) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernel itself (the "
                    "tests below); older Tritons' interpreters cannot run its loop")
def test_kernel_matches_reference_in_the_interpreter():
    """Triton's interpreter on the CPU: the kernel's split, merge and counters, the page
    gathers and the FP8 scales, as the GPU runs them."""
    run_interpreted("import torch, tests.test_decode_attention as t; "
                    "t.check_cases(torch.float16, 'cpu'); print('checked')", timeout=300)


@pytest.mark.gpu
def test_kernel_matches_reference_on_the_gpu():
    check_cases(torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_kernel_replays_in_a_graph_on_new_page_tables():
    """Captured once over one page table, replayed over others (the graph runner's use): each
    replay gives the eager launch's bytes for its table."""
    from kernels.decode_attention import DecodeAttention

    heads, kv_heads, page = 32, 8, 16
    cache, q, meta = paged_case([40, 900, 3, 2500], heads, kv_heads, page, torch.bfloat16,
                                "cuda", total=512)
    pages = torch.zeros(2048, dtype=torch.int32, device="cuda")
    graphed = DecodeAttention(4, pages, heads, kv_heads, 128, page, 128 ** -0.5)
    eager = DecodeAttention(4, torch.zeros_like(pages), heads, kv_heads, 128, page, 128 ** -0.5)
    graphed.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
    out = graphed.run(q, cache)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graphed.run(q, cache)
    g = torch.Generator().manual_seed(1)
    for ctxs in ([40, 900, 3, 2500], [1, 1, 1, 1], [4000, 77, 128, 129]):
        meta = page_table(ctxs, page, len(cache), g, "cuda")
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        graphed.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
        graph.replay()
        eager.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
        want = eager.run(q, cache)
        torch.cuda.synchronize()
        assert torch.equal(out, want), ctxs
        assert torch.allclose(out.float(), reference(q, cache, meta, heads, kv_heads, (1.0, 1.0))
                              .float(), atol=2e-2), ctxs
        assert int(graphed.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_the_backend_runs_the_kernel_at_every_batch_but_long_few_row_steps(monkeypatch, kv_dtype):
    """Every decode step, graphed (a graph's wrapper) or eager (the step's plan), takes the
    kernel, but a step of up to ``MAX_ROWS`` rows with a row past ``SMALL_DECODE_MAX_CONTEXT``
    tokens: FlashInfer's, eager and through a second graph of the size (none for larger sizes,
    whose long steps stay on the kernel). ``BATON_SMALL_DECODE=few`` keeps FlashInfer above
    ``MAX_ROWS`` rows, ``0`` everywhere."""
    from engine.attention.flashinfer_backend import SMALL_DECODE_MAX_CONTEXT, FlashInferBackend
    from engine.forward_context import null_meta
    from kernels.decode_attention import MAX_ROWS, DecodeAttention

    def backend():
        return FlashInferBackend(32, 8, 128, 128 ** -0.5, 16, torch.device("cuda"),
                                 torch.bfloat16, kv_dtype=kv_dtype)

    def meta(rows: int, long: bool = False):
        m = null_meta(rows, 1, 16)
        if long:
            m.context_lens = [5] * (rows - 1) + [SMALL_DECODE_MAX_CONTEXT + 1]
        return m

    pages = torch.zeros(8192, dtype=torch.int32, device="cuda")
    on = backend()
    for size in (1, MAX_ROWS, MAX_ROWS + 8, 256):
        assert isinstance(on.graph_decode_wrapper(size, pages), DecodeAttention), size
    assert not isinstance(on.graph_decode_wrapper(2, pages, long_context=True),
                          (DecodeAttention, type(None)))
    assert on.graph_decode_wrapper(MAX_ROWS + 8, pages, long_context=True) is None
    for rows, long in ((1, False), (MAX_ROWS + 1, False), (100, False), (2, True),
                       (MAX_ROWS + 1, True), (100, True)):
        m = meta(rows, long)
        on.plan(m)
        kernel = isinstance(m.extras["wrapper"], DecodeAttention)
        assert kernel == (not long or rows > MAX_ROWS), (rows, long)
        assert on.long_context(m) == (long and rows <= MAX_ROWS)
    monkeypatch.setenv("BATON_SMALL_DECODE", "few")
    few = backend()
    assert isinstance(few.graph_decode_wrapper(MAX_ROWS, pages), DecodeAttention)
    assert not isinstance(few.graph_decode_wrapper(MAX_ROWS + 8, pages), DecodeAttention)
    assert few.graph_decode_wrapper(MAX_ROWS + 8, pages, long_context=True) is None
    m = meta(MAX_ROWS + 1)
    few.plan(m)
    assert not isinstance(m.extras["wrapper"], DecodeAttention)
    monkeypatch.setenv("BATON_SMALL_DECODE", "0")
    off, m = backend(), meta(1)
    off.plan(m)
    assert not isinstance(off.graph_decode_wrapper(1, pages), DecodeAttention)
    assert off.graph_decode_wrapper(1, pages, long_context=True) is None
    assert not isinstance(m.extras["wrapper"], DecodeAttention)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_many_rows_match_the_reference(fp8):
    """The launches of more than ``MAX_ROWS`` rows (their own tiles, warps and stages: 12 rows,
    whose KV is split, 24, 48 and 100) over a bf16 and an FP8 cache, long rows too, against the
    torch reference."""
    from kernels.decode_attention import DecodeAttention

    g = torch.Generator().manual_seed(3)
    for rows in (12, 24, 48, 100):
        ctxs = torch.randint(1, 5000, (rows,), generator=g).tolist()
        cache, q, meta = paged_case(ctxs, 32, 8, 16, torch.bfloat16, "cuda", fp8=fp8, seed=rows)
        pages = torch.zeros(len(meta.kv_indices), dtype=torch.int32, device="cuda")
        dec = DecodeAttention(rows, pages, 32, 8, 128, 16, 128 ** -0.5)
        dec.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
        scales = (0.5, 1.5) if fp8 else (1.0, 1.0)
        got = dec.run(q, cache, *scales)
        want = reference(q, cache, meta, 32, 8, scales)
        assert (got.float() - want.float()).abs().max().item() < 2e-2, rows
