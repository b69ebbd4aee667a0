"""Kernels against their torch references (the CPU path is the reference itself)."""

import pytest
import torch

from kernels import (copy_blocks, copy_blocks_reference, qk_norm_rope_store,
                     qk_norm_rope_store_reference, rmsnorm, rmsnorm_reference, silu_and_mul,
                     silu_and_mul_reference, store_kv_reference)
from kernels.gemv import GemvConfig, config_for


def _cache(blocks, dtype, device, layers=3):
    return torch.randn(layers, blocks, 2, 2, 4, 8, dtype=dtype, device=device)


def _check_copy_blocks(device, dtype):
    g = torch.Generator().manual_seed(0)
    src, dst = _cache(20, dtype, device), _cache(12, dtype, device)
    src_ids = torch.randperm(20, generator=g)[:7].to(device)
    dst_ids = torch.randperm(12, generator=g)[:7].to(device)
    want = dst.clone()
    copy_blocks_reference(src, want, src_ids, dst_ids)
    copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst, want)
    assert torch.equal(dst[:, dst_ids], src[:, src_ids])


def test_copy_blocks_cpu():
    _check_copy_blocks("cpu", torch.float32)


def test_store_kv_skips_negative_slots():
    cache = torch.zeros(4, 2, 2, 4, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_reference(k, v, cache, torch.tensor([5, -1, 12]))
    want = torch.zeros_like(cache)
    want[1, 0, :, 1], want[1, 1, :, 1] = k[0], v[0]  # slot 5: block 1, offset 1
    want[3, 0, :, 0], want[3, 1, :, 0] = k[2], v[2]  # slot 12: block 3, offset 0
    assert torch.equal(cache, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_triton_matches_reference(dtype):
    _check_copy_blocks("cuda", dtype)


# -- Triton kernels of the model (CUDA) against their torch references ------------------------
def _close(a, b, dtype):
    """float32: to rounding; bf16: the fused kernels round once where the references round after
    every op, so single elements may differ by one bf16 step (1/64 at magnitude 2-4)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    assert ((a.float() - b.float()).norm() / b.float().norm()).item() < tol / 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 1024, 5120])
def test_rmsnorm_triton_matches_reference(dtype, dim):
    x, res = (torch.randn(37, dim, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.rand(dim, device="cuda", dtype=dtype) + 0.5
    _close(rmsnorm(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6), dtype)
    out, new_res = rmsnorm(x, w, 1e-6, res)
    want, want_res = rmsnorm_reference(x, w, 1e-6, res)
    _close(out, want, dtype)
    assert torch.equal(new_res, want_res)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_triton_matches_reference(dtype):
    x = torch.randn(19, 2 * 3072, device="cuda", dtype=dtype)
    _close(silu_and_mul(x), silu_and_mul_reference(x), dtype)


def check_qk_norm_rope_store(device: str, dtype: torch.dtype, heads=(16, 8), t: int = 21,
                             tiles=(None, (1, 1), (16, 4), (4, 2))) -> None:
    """The fused prologue against the unfused torch path, with a token a program and with tiles
    of tokens (the last one partly past the step's tokens), skipped slots among them."""
    hq, hk = heads
    d, bs, layers = 128, 16, 3
    blocks = -(-t // bs) + 2
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    positions = torch.randint(0, 4000, (t,), generator=g).to(device)
    qw, kw = ((torch.rand(d, generator=g) + 0.5).to(device, dtype) for _ in range(2))
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(4096).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    slots = torch.randperm(blocks * bs, generator=g)[:t].to(device)
    slots[[2, 7]] = -1
    for tile in tiles:
        # Block-major storage seen layer by layer, as the engine keeps it.
        storage = torch.zeros(blocks, layers, 2, hk, bs, d, device=device, dtype=dtype)
        cache, ref_cache = storage.transpose(0, 1)[1], storage.clone().transpose(0, 1)[1]
        q = qk_norm_rope_store(qkv, positions, qw, kw, 1e-6, cos_sin, cache, slots, hq, hk,
                               tile=tile)
        want = qk_norm_rope_store_reference(qkv, positions, qw, kw, 1e-6, cos_sin, ref_cache,
                                            slots, hq, hk)
        _close(q, want, dtype)
        _close(cache, ref_cache, dtype)
        assert storage.transpose(0, 1)[0].abs().sum() == 0  # other layers untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (4, 4)])
def test_qk_norm_rope_store_triton_matches_reference(dtype, heads):
    check_qk_norm_rope_store("cuda", dtype, heads)
    check_qk_norm_rope_store("cuda", dtype, heads, t=300, tiles=(None,))  # a prefill's tiles


@pytest.mark.gpu
def test_qk_norm_rope_store_compiles_once_for_every_token_count():
    """The step's token count is not specialised on: a served step of a count not divisible by
    16 after one that is compiles nothing (measured: a second kernel compiled mid-serving)."""
    from kernels.rope import _qk_norm_rope_store_kernel as kernel
    check_qk_norm_rope_store("cuda", torch.bfloat16, t=32, tiles=(None,))
    compiled = kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    check_qk_norm_rope_store("cuda", torch.bfloat16, t=21 + 16, tiles=(None,))
    assert len(compiled) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_qk_norm_rope_store_tiles_in_the_interpreter():
    """The prologue's token tiles (masks past the last token, skipped slots) on the CPU."""
    _interpreted("check_qk_norm_rope_store")


GEMV_CONFIGS = [GemvConfig(), GemvConfig(4, 512, 4, 2), GemvConfig(4, 1024, 8, 2),
                GemvConfig(8, 512, 4, 4), GemvConfig(8, 1024, 8, 2), GemvConfig(4, 2048, 4, 2),
                GemvConfig(16, 1024, 4, 2), GemvConfig(4, 2048, 8, 2), GemvConfig(4, 4096, 8, 2),
                GemvConfig(2, 1024, 4, 2), GemvConfig(16, 512, 8, 2)]


def test_gemv_config_follows_the_measured_winners():
    # On the H100 (docs/benchmarks.md): the best of `projections_bench chain --grid` (the step's
    # projections chained under programmatic dependent launch) for 0.6B, 1.7B and 4B, the rules
    # elsewhere (8B: the best of `projections_bench bf16 --streaming`, within 0.5% of the chain's).
    winners = {(4096, 1024): (16, 1024, 4, 2), (1024, 2048): (4, 2048, 8, 2),
               (6144, 1024): (8, 512, 4, 4), (1024, 3072): (4, 4096, 8, 2),
               (19456, 2560): (4, 512, 4, 2), (2560, 9728): (2, 2048, 8, 2),
               (6144, 4096): (4, 2048, 4, 2), (4096, 4096): (4, 2048, 4, 2),
               (24576, 4096): (4, 2048, 4, 2), (4096, 12288): (4, 2048, 4, 2),
               (3000, 1024): (4, 512, 4, 2), (5120, 2048): (4, 1024, 8, 2)}
    for (n, k), cfg in winners.items():
        assert tuple(config_for(n, k)) == cfg


def test_fp8_gemv_config_follows_the_measured_winners():
    # `projections_bench chain --grid` on the H100, Qwen3-8B with FP8 weights.
    from kernels.fp8 import fp8_gemv_config
    winners = {(6144, 4096): (16, 512, 8, 2), (4096, 4096): (4, 2048, 8, 2),
               (24576, 4096): (16, 512, 8, 2), (4096, 12288): (4, 2048, 8, 2),
               # Qwen3-32B's and 0.6B's own (FP8_CHAIN_WINNERS); 14B's take the rule
               (10240, 5120): (4, 1024, 4, 2), (5120, 8192): (2, 2048, 4, 2),
               (51200, 5120): (4, 1024, 4, 2), (5120, 25600): (2, 2048, 4, 2),
               (1024, 3072): (4, 4096, 8, 2), (151936, 1024): (16, 512, 8, 2),  # 0.6B down, head
               (7168, 5120): (16, 512, 8, 2), (5120, 17408): (4, 2048, 8, 2)}
    for (n, k), cfg in winners.items():
        assert tuple(fp8_gemv_config(n, k)) == cfg


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", [(1000, 1024), (4096, 3072), (300, 1000)])  # N, K (odd K too)
def test_gemv_triton_matches_reference(rows, shape):
    from kernels.gemv import gemv, gemv_reference
    n, k = shape
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    want = gemv_reference(x, w).float()
    for cfg in GEMV_CONFIGS:
        got = gemv(x, w, cfg)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert ((got.float() - want).norm() / want.norm()).item() < 5e-3, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 3072), (4096, 12288), (300, 1000)])  # N, K (odd K)
def test_one_row_kernels_with_the_silu_folded_in_equal_silu_then_the_kernel(shape):
    """The down projection of one row computing the SiLU-and-multiply of its ``[gate | up]``
    input itself: the same output as the SiLU kernel then the projection, bf16 and FP8 (both
    weight formats)."""
    from kernels import silu_and_mul
    from kernels.fp8 import fp8_gemv, fp8_gemv_config, quantize_per_block, quantize_per_channel
    from kernels.gemv import config_for, gemv
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n)
    gate_up = torch.randn(1, 2 * k, device="cuda", generator=g).to(torch.bfloat16) * 3
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    act = silu_and_mul(gate_up)
    assert torch.equal(gemv(gate_up, w, config_for(n, k), silu=True),
                       gemv(act, w, config_for(n, k)))
    cfg = fp8_gemv_config(n, k)
    for q, s, block in ((*quantize_per_channel(w), None),
                        (*quantize_per_block(w, (128, 128)), (128, 128))):
        assert torch.equal(fp8_gemv(gate_up, q, s, block, cfg, silu=True),
                           fp8_gemv(act, q, s, block, cfg))


# Packed gate/up shapes ``(2 * intermediate, hidden)``: Qwen3-8B's and 0.6B's on the GPU, small
# ones in the interpreter; the last of each has a program holding a single pair (its other rows
# masked) and a K that is no multiple of the tiles.
GLU_SHAPES = {"cuda": [(2 * 12288, 4096), (2 * 3072, 1024), (2 * 1001, 300)],
              "cpu": [(2 * 64, 1024), (2 * 37, 300)]}


def check_glu_epilogue(device: str, dtype: torch.dtype) -> None:
    """The one-row gate/up projection ending in the SiLU-and-multiply (``glu``) gives the bytes
    of the projection then the SiLU kernel: bf16 (or fp16) weights and FP8 per channel, at the
    engine's configs and at a few others; the block-scaled FP8 format falls back to the two."""
    from kernels.fp8 import fp8_gemv, fp8_gemv_config, quantize_per_block, quantize_per_channel
    from kernels.gemv import gemv
    for n, k in GLU_SHAPES[device]:
        g = torch.Generator(device=device).manual_seed(n)
        x = (torch.randn(1, k, device=device, generator=g) * 2).to(dtype)
        w = (torch.randn(n, k, device=device, generator=g) * 0.05).to(dtype)
        for cfg in {config_for(n, k), GemvConfig(2, 512, 4, 2), GemvConfig(16, 1024, 8, 2)}:
            got = gemv(x, w, cfg, glu=True)
            assert got.shape == (1, n // 2)
            assert torch.equal(got, silu_and_mul(gemv(x, w, cfg))), (n, k, cfg)
        q, s = quantize_per_channel(w)
        for cfg in {fp8_gemv_config(n, k), GemvConfig(2, 512, 4, 2)}:
            assert torch.equal(fp8_gemv(x, q, s, None, cfg, glu=True),
                               silu_and_mul(fp8_gemv(x, q, s, None, cfg))), (n, k, cfg)
        if n % 128 == 0 and k % 128 == 0:
            qb, sb = quantize_per_block(w, (128, 128))
            cfg = fp8_gemv_config(n, k)
            assert torch.equal(fp8_gemv(x, qb, sb, (128, 128), cfg, glu=True),
                               silu_and_mul(fp8_gemv(x, qb, sb, (128, 128), cfg)))
    # Configs of an odd row count cannot pair gate and up rows: the two kernels instead.
    n, k = GLU_SHAPES[device][-1]
    w = torch.randn(n, k, device=device).to(dtype)
    x = torch.randn(1, k, device=device).to(dtype)
    assert torch.equal(gemv(x, w, GemvConfig(1, 512, 4, 2), glu=True),
                       silu_and_mul(gemv(x, w, GemvConfig(1, 512, 4, 2))))


def check_few_row_fp8(device: str, dtype: torch.dtype) -> None:
    """The few-row FP8 kernel (``fp8_skinny_mm``), channel and block formats, K split in 1, 2
    and 4 ranges, a masked K tail, at the engine's tiles and others: each against the float32
    reference."""
    from kernels.fp8 import fp8_gemv_reference, fp8_skinny_mm, quantize_per_block
    from kernels.fp8 import quantize_per_channel
    g = torch.Generator(device=device).manual_seed(1)
    for n, k, fmt in [(256, 512, "block"), (200, 384, "channel"), (96, 320, "channel"),
                      (192, 2048, "channel")]:
        w = torch.randn(n, k, device=device, generator=g) * 0.05
        block = (128, 128) if fmt == "block" else None
        q, s = quantize_per_block(w, block) if block else quantize_per_channel(w)
        for m in (2, 5, 12):
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            ref = fp8_gemv_reference(x, q, s, block).float()
            # the engine's tiles, and smaller and wider ones (the chain grid's, 8 warps)
            for kw in (dict(block_n=32, block_k=128), {},
                       dict(block_n=64, block_k=512, num_warps=8)):
                for split in (1, 2, 4):
                    width = 128 if block else kw.get("block_k", 256)
                    if split > 1 and k % (split * width):
                        continue
                    y = fp8_skinny_mm(x, q, s, block, split=split, **kw).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (n, k, fmt, m, kw, split, err)


def check_argmax(device: str, dtype: torch.dtype) -> None:
    """:class:`kernels.argmax.RowArgmax` against ``torch.argmax``: a vocabulary's worth of
    columns and widths that leave the last block short, ties within and across blocks (the
    first column wins), a row of -inf, NaN, and rows past what the workspace first held."""
    from kernels.argmax import BLOCK, RowArgmax
    g = torch.Generator().manual_seed(0)
    argmax = RowArgmax()
    for rows, n in ((1, 151936), (3, 2 * BLOCK + 5), (2, BLOCK), (8, 1), (5, 5000), (9, 300)):
        x = torch.randn(rows, n, generator=g).to(dtype)
        if n > BLOCK + 10:
            top = x.max() + 1
            x[0, [7, BLOCK + 3, n - 1]] = top  # the same largest value in three blocks
            x[-1, [n - 2, n - 1]] = top  # twice in the last, short block
        x[1 % rows] = float("-inf")  # nothing allowed: torch's argmax is column 0
        x = x.to(device)
        got = argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), x.argmax(-1).cpu()), (rows, n)
    x = torch.randn(2, 5000, generator=g).to(dtype)
    x[0, 4000] = float("nan")
    x[1, 3] = float("nan")
    x[1, 4999] = float("nan")
    assert argmax(x.to(device)).tolist() == [4000, 3]
    assert argmax(x[:, 100:].to(device)).tolist() == x[:, 100:].argmax(-1).tolist()  # strided
    out = torch.full((4,), -7, dtype=torch.int64, device=device)  # a graph's static buffer
    assert argmax(x.to(device), out=out[:2]) is not None and out.tolist() == [4000, 3, -7, -7]


def check_draw(device: str, dtype: torch.dtype = None, rows: int = 1200) -> None:
    """:class:`kernels.argmax.RowArgmax` with ``draw``: rows at inverse temperature 0 take the
    plain argmax; sampled rows' draws over many (salt, position) keys follow
    ``softmax(logits * inv_temp)``, two temperatures of one row apart; the same keys draw the
    same ids (whatever the batch), and a vocabulary's worth of columns spread over blocks is
    drawn from too. :func:`~kernels.argmax.draw_reference` is held to the same."""
    from kernels.argmax import RowArgmax, draw_reference
    g = torch.Generator().manual_seed(1)
    base = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, float("-inf")])
    x = base.repeat(rows, 1)
    x[0] = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.0, 0.0])
    inv_temp = torch.tensor([0.0] + [0.5, 2.0] * (rows // 2))[:rows]
    salt = torch.randint(0, 2 ** 31 - 1, (rows,), generator=g, dtype=torch.int32)
    pos = torch.randint(0, 2 ** 40, (rows,), generator=g)
    for fn in (lambda *a: RowArgmax()(a[0], draw=a[1:]), draw_reference):
        args = [t.to(device) for t in (x, inv_temp, salt, pos)]
        got = fn(*args).cpu()
        assert got[0] == 1
        for t in (0.5, 2.0):
            drawn = got[1:][inv_temp[1:] == t]
            freq = torch.bincount(drawn, minlength=6).float() / len(drawn)
            assert (freq - torch.softmax(base * t, -1)).abs().max() < 0.06, (t, freq)
        # the same keys, fewer rows in another order: the same ids
        pick = torch.tensor([5, 2, 0, 9])
        again = fn(*[a[pick.to(device)] for a in args]).cpu()
        assert torch.equal(again, got[pick])
    wide = torch.full((16, 151936), -30.0)  # three columns in three blocks, the rest ~0
    wide[:, [17, 70000, 151935]] = torch.tensor([0.0, 1.0, 0.5])
    draws = RowArgmax()(wide.to(device), draw=tuple(t.to(device) for t in (
        torch.ones(16), torch.arange(16, dtype=torch.int32), torch.full((16,), 3))))
    assert set(draws.tolist()) == {17, 70000, 151935}


def check_cut_draw(device: str, dtype: torch.dtype = None, freq_rows: int = 0,
                   wide: bool = False) -> None:
    """Sampled rows cut to a top-k and top-p (``draw``'s ``top_k``, ``top_p``): each row's id
    is the uncut draw, with the same keys, over the columns
    :func:`~kernels.argmax.cut_reference` keeps. Rows of three blocks, bfloat16-rounded (ties
    with the k-th across blocks); a block holding more ties with the k-th than it keeps
    candidates (read again), and a top-p floor above such ties; a row with fewer finite columns
    than its k; top-k 1 and ``TOP_K_MAX``; greedy and uncut sampled rows in the same launch.
    :func:`~kernels.argmax.draw_reference` (and, given ``freq_rows``, the kernel) draws a small
    row's kept columns at the cut distribution's frequencies. ``wide``: rows of Qwen3's
    vocabulary too (75 blocks, 7 levels of the merge; ~7 minutes in the interpreter)."""
    from kernels.argmax import BLOCK, TOP_K_MAX, RowArgmax, cut_reference, draw_reference
    g = torch.Generator().manual_seed(2)
    n = 2 * BLOCK + 300

    def row():
        return (torch.randn(n, generator=g) * 2).to(torch.bfloat16).float()
    ties = torch.full((n,), -5.0)
    ties[BLOCK + 10:BLOCK + 60] = 9.0  # fifty ties with the 4th largest in one block
    ties[[3, 2 * BLOCK + 5]] = 9.5
    sparse = torch.full((n,), float("-inf"))
    sparse[[7, BLOCK + 1]] = torch.tensor([1.0, 0.5])
    cases = [(row(), 1.0, 20, 0.9), (row(), 0.5, TOP_K_MAX, 1.0), (row(), 2.0, 5, 0.5),
             (ties, 1.0, 4, 1.0), (ties, 1.0, 4, 0.05), (sparse, 1.0, 8, 0.95),
             (row(), 1.0, 1, 1.0), (row(), 0.0, 0, 1.0), (row(), 1.0, 0, 1.0)]
    cases += cases[3:5]  # the ties again, with other keys
    x = torch.stack([c[0] for c in cases])
    inv_temp = torch.tensor([c[1] for c in cases])
    top_k = torch.tensor([c[2] for c in cases], dtype=torch.int32)
    top_p = torch.tensor([c[3] for c in cases])
    salt = torch.arange(len(cases), dtype=torch.int32) * 7919
    pos = torch.randint(0, 2 ** 40, (len(cases),), generator=g)
    got = _cut_draws_as_uncut(device, x, inv_temp, salt, pos, top_k, top_p)
    assert got[7] == x[7].argmax() and got[6] == x[6].argmax()
    assert 10 + BLOCK <= got[3] < BLOCK + 60 or got[3] in (3, 2 * BLOCK + 5)
    assert got[4] in (3, 2 * BLOCK + 5) and got[5] in (7, BLOCK + 1)
    if wide:
        check_wide_cut_draw(device)
    base = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0, 1.0])
    for k, p in ((3, 1.0), (5, 0.9), (5, 1.0)):  # the 3 and 2s; the 1 too where top-p is 1
        want = torch.softmax(base.masked_fill(~cut_reference(base, k, p), float("-inf")), -1)
        rows = max(freq_rows, 3000)
        args = (base.repeat(rows, 1), torch.ones(rows), torch.arange(rows, dtype=torch.int32),
                torch.full((rows,), 5), torch.full((rows,), k, dtype=torch.int32),
                torch.full((rows,), p))
        fns = [draw_reference] + ([lambda *a: RowArgmax()(a[0], draw=a[1:])] if freq_rows
                                  else [])
        for fn in fns:
            drawn = fn(*[a.to(device) for a in args]).cpu()
            freq = torch.bincount(drawn, minlength=6).float() / rows
            assert (freq - want).abs().max() < 0.04, (k, p, freq, want)


def check_wide_cut_draw(device: str) -> None:
    """Cut draws over Qwen3's 151,936 columns: each the uncut draw over the kept columns, with
    the same keys (Qwen3's 0.6 / 20 / 0.95, top-k ``TOP_K_MAX``, ties with the k-th spread
    over blocks, a row's top values in its last, partial block)."""
    from kernels.argmax import TOP_K_MAX
    g = torch.Generator().manual_seed(3)
    n = 151936
    x = (torch.randn(8, n, generator=g) * 3).to(torch.bfloat16).float()
    x[2] = x[2].round()  # many ties everywhere
    x[3, -40:] += 20.0  # the best in the last block
    cases = [(1 / 0.6, 20, 0.95), (1.0, TOP_K_MAX, 1.0), (1.0, 20, 0.95), (2.0, 7, 0.8)]
    cases = [cases[r % 4] for r in range(8)]
    inv_temp, top_k, top_p = (torch.tensor(c, dtype=d) for c, d in zip(
        zip(*cases), (torch.float32, torch.int32, torch.float32)))
    salt = torch.arange(8, dtype=torch.int32) * 31
    pos = torch.randint(0, 2 ** 40, (8,), generator=g)
    _cut_draws_as_uncut(device, x, inv_temp, salt, pos, top_k, top_p)


def _cut_draws_as_uncut(device, x, inv_temp, salt, pos, top_k, top_p) -> torch.Tensor:
    """The kernel's cut draws of ``x``'s rows (returned on the CPU), asserted equal to its
    uncut draws with the same keys over the columns :func:`~kernels.argmax.cut_reference` keeps
    (sampled rows; greedy ones unmasked)."""
    from kernels.argmax import RowArgmax, cut_reference
    masked = x.clone()
    for r in range(x.shape[0]):
        if inv_temp[r] > 0:
            masked[r][~cut_reference(x[r] * inv_temp[r], int(top_k[r]), float(top_p[r]))] = \
                float("-inf")
    dev = [t.to(device) for t in (x, masked, inv_temp, salt, pos, top_k, top_p)]
    got = RowArgmax()(dev[0], draw=tuple(dev[2:])).cpu()
    assert torch.equal(got, RowArgmax()(dev[1], draw=tuple(dev[2:5])).cpu()), got
    return got


def check_take_pending(device: str, dtype: torch.dtype = None) -> None:
    """:func:`kernels.pending_ids.take_pending`: rows with a pending row take the running
    step's token from it (any row, in any order, one row twice), the others keep the id the host
    wrote, padding rows (-1) included; rows past ``n`` are never touched."""
    from kernels.pending_ids import take_pending
    tokens = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64, device=device)
    for n, src in ((1, [0]), (1, [-1]), (3, [2, -1, 2]), (5, [4, 3, 2, 1, 0]),
                   (20, [1, -1] * 10)):
        buf = torch.arange(100, 124, dtype=torch.int64, device=device)
        srcs = torch.tensor(src + [0] * 4, dtype=torch.int64, device=device)
        take_pending(buf[:n], srcs[:n], tokens)
        want = [tokens[s].item() if s >= 0 else 100 + r for r, s in enumerate(src)]
        assert buf.tolist() == want + list(range(100 + n, 124)), (n, src)


def check_take_inputs(device: str, dtype: torch.dtype = None) -> None:
    """:func:`kernels.pending_ids.take_inputs`: a step's words (``StagedInputs``' layout) read
    from the host buffer into the device one, as many as its rows and page table take (tables
    inside the first block of words and past it), then the pending ids from ``tokens``; the
    device words past the step's are not touched. And the argmax's host copy of its result."""
    from engine.cuda_graph import StagedInputs
    from kernels.argmax import RowArgmax
    from kernels.pending_ids import take_inputs
    pinned = device == "cuda"  # (a kernel reads host memory only where it is pinned)
    tokens = torch.tensor([21, 22, 23, 24], dtype=torch.int64, device=device)
    for size, pages in ((1, 3), (4, 9), (2, 700), (8, 1)):
        host = torch.zeros(2048, dtype=torch.int64, pin_memory=pinned)
        rows = torch.stack([torch.arange(size) + 100, torch.arange(size) + 7,
                            torch.arange(size) + 50, torch.tensor([1, -1] * 4)[:size]])
        host[:4 * size] = rows.reshape(-1)
        indptr, last, table = StagedInputs._table(host, size, pages)
        indptr.copy_(torch.linspace(0, pages, size + 1).round().int())
        last.fill_(5)
        table.copy_(torch.arange(pages) * 3 + 1)
        used = 4 * size + StagedInputs._table_words(size, pages)
        dev = torch.full((2048,), -9, dtype=torch.int64, device=device)
        take_inputs(host, dev, tokens, size)
        want = host.clone()
        want[:size] = torch.where(rows[3] >= 0, tokens.cpu()[rows[3].clamp(min=0)], rows[0])
        want[used:] = -9
        assert torch.equal(dev.cpu(), want), (size, pages)
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.zeros(3, dtype=torch.int64, device=device)
    host = torch.zeros(3, dtype=torch.int64, pin_memory=pinned)
    RowArgmax()(x, out=out, host=host)
    assert out.tolist() == host.tolist() == x.argmax(-1).tolist()


def check_ahead_inputs(device: str, dtype: torch.dtype = None) -> None:
    """:func:`kernels.ahead_inputs.ahead_inputs` writes what the host writes for the same draft
    step (``ModelRunner.prepare`` of one row a sequence, padded to the graph's size, in
    ``StagedInputs``' layout), for every count of kept proposals: none, some (the target's
    token after the last kept), all (the last proposal, in the block it shares with the
    position after it or not); sequences of different ``k``, a padded graph, pages past one
    loop of the copy."""
    from types import SimpleNamespace

    from engine.cuda_graph import DecodeGraphs, StagedInputs
    from engine.draft_model import _View
    from engine.model_runner import ModelRunner
    from engine.scheduler import ScheduledBatch
    from kernels.ahead_inputs import PAGE_BLOCK, ahead_inputs
    bs, g = 4, torch.Generator().manual_seed(0)
    host = SimpleNamespace(block_size=bs, _as_rows=lambda batch: True)
    for ks, size, longest in (([4], 1, 40), ([4, 2, 3], 4, 40), ([1, 4], 2, 40),
                              ([4], 1, bs * PAGE_BLOCK + 30)):
        for trial in range(5):
            kept, drawn, proposed, fields, tables, views, ns = [], [], [], [], [], [], []
            lengths = torch.randint(1, longest, (len(ks),), generator=g).tolist()
            width = max(-(-(n + k + 1) // bs) for n, k in zip(lengths, ks))
            for length, k in zip(lengths, ks):
                n = (trial + k) % (k + 1)
                tokens = torch.randint(1, 1000, (length,), generator=g).tolist()
                pages = -(-(length + k + 1) // bs)
                table = (torch.randperm(4 * width * len(ks), generator=g)[:pages] + 1).tolist()
                props = torch.randint(1, 1000, (k,), generator=g).tolist()
                own = torch.randint(1, 1000, (k + 1,), generator=g).tolist()
                fields += [len(kept), k, length - 1]
                # kept up to n, then a rejection, then anything (never read)
                kept += [i < n or (i > n and bool(i % 2)) for i in range(k)] + [False]
                proposed += props + [-1]
                drawn += own
                tables += table + [0] * (width - pages)
                more = props[:n] + ([own[n]] if n < k else [])
                views.append(_View(tokens + more, table, length + len(more) - 1, 1))
                ns.append(n)
            words = torch.zeros(4 * size + size + 2 * width * size, dtype=torch.int64,
                                device=device)
            i64 = dict(dtype=torch.int64, device=device)
            got = ahead_inputs(words, size, torch.tensor(kept, device=device),
                               torch.tensor(drawn, **i64), torch.tensor(proposed, **i64),
                               torch.tensor(fields, **i64).view(-1, 3),
                               torch.tensor(tables, **i64).view(-1, width), bs, 0, max(ks))
            step = ModelRunner.prepare(host, ScheduledBatch(views, [1] * len(views)))
            meta = DecodeGraphs._padded_meta(step.meta, size)
            expect = torch.zeros(words.shape, dtype=torch.int64)
            expect[:4 * size] = step.host_rows(size).view(-1)
            for part, value in zip(StagedInputs._table(expect, size, len(meta.kv_indices)),
                                   (meta.kv_indptr, meta.kv_last_page_len, meta.kv_indices)):
                part.copy_(value)
            assert got.tolist() == ns
            assert torch.equal(words.cpu(), expect)


INTERPRETED = """
import torch, kernels.activation, kernels.argmax, kernels.fp8, kernels.gemv, kernels.rope
import kernels.pending_ids
for module in (kernels.activation, kernels.argmax, kernels.fp8, kernels.gemv, kernels.rope,
               kernels.pending_ids):
    module.use_triton = lambda t: True  # the interpreter runs kernels on CPU tensors
torch.cuda.is_current_stream_capturing = lambda: False  # (asked before the counters are made)
import tests.test_kernels as t
t.{check}('cpu', torch.float16)
print('checked')
"""


def _interpreted(check: str) -> None:
    """``check`` (a function here) run by Triton's interpreter on the CPU."""
    from tests.interpreter import run_interpreted
    run_interpreted(INTERPRETED.format(check=check), timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_glu_epilogue_equals_projection_then_silu_in_the_interpreter():
    """Triton's interpreter on the CPU (float16: it misreads bfloat16): the pairs each program
    streams, their masks and the epilogue's rounding, as the GPU runs them."""
    _interpreted("check_glu_epilogue")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_argmax_kernel_in_the_interpreter():
    """The one-launch argmax's blocks, partials and counters on the CPU."""
    _interpreted("check_argmax")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_kernel_on_the_gpu(dtype):
    check_argmax("cuda", dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_draw_kernel_in_the_interpreter():
    """Sampled rows of the one-launch argmax (Philox in the interpreter) on the CPU."""
    _interpreted("check_draw")


@pytest.mark.gpu
def test_draw_kernel_on_the_gpu():
    check_draw("cuda", rows=20000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_cut_draw_kernel_in_the_interpreter():
    """Rows cut to a top-k and top-p, drawn in the one launch (Philox in the interpreter)."""
    _interpreted("check_cut_draw")


@pytest.mark.gpu
def test_cut_draw_kernel_on_the_gpu():
    check_cut_draw("cuda", freq_rows=20000, wide=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_pending_ids_kernel_in_the_interpreter():
    _interpreted("check_take_pending")


def test_pending_ids_reference():
    check_take_pending("cpu")


@pytest.mark.gpu
def test_pending_ids_kernel_on_the_gpu():
    check_take_pending("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_a_steps_inputs_read_from_the_host_in_the_interpreter():
    _interpreted("check_take_inputs")


def test_a_steps_inputs_read_from_the_host_reference():
    check_take_inputs("cpu")


@pytest.mark.gpu
def test_a_steps_inputs_read_from_pinned_memory_on_the_gpu():
    """On the GPU the host buffer is pinned (the kernel reads it across the bus)."""
    check_take_inputs("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_a_drafts_step_ahead_has_the_hosts_inputs_in_the_interpreter():
    """The inputs of the draft's step queued behind a verification, written on the device
    (engine.draft_model's step ahead), against the host's for the same step."""
    _interpreted("check_ahead_inputs")


@pytest.mark.gpu
def test_a_drafts_step_ahead_has_the_hosts_inputs_on_the_gpu():
    check_ahead_inputs("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the kernels themselves")
def test_few_row_fp8_kernel_in_the_interpreter():
    """The few-row kernel's tiles, masks, split partials and counters on the CPU (its GPU
    tests: tests/test_gpu_fp8.py)."""
    _interpreted("check_few_row_fp8")


@pytest.mark.gpu
def test_glu_epilogue_equals_projection_then_silu_on_the_gpu():
    check_glu_epilogue("cuda", torch.bfloat16)


@pytest.mark.gpu
def test_a_one_row_chain_under_pdl_gives_the_bytes_it_gives_without_eager_and_graphed():
    """A batch-1 step's kernels in a row (RMSNorm, projection, norm folded into a projection,
    SiLU folded into a projection, an FP8 projection), launched with programmatic dependent
    launch where the GPU has it: each waits for the one before, so the bytes are those of the
    launches without it, run eagerly and replayed in a CUDA graph on new inputs."""
    from kernels import rmsnorm
    from kernels._triton import PDL_MAX_ROWS, pdl, set_pdl
    from kernels.fp8 import fp8_gemv, fp8_gemv_config, fp8_supported, quantize_per_channel
    from kernels.gemv import gemv, norm_gemv
    g = torch.Generator(device="cuda").manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    hidden, inter = 1024, 3072
    nw = rand(hidden, scale=0.1) + 1
    w_qkv, w_o, w_gu, w_down = (rand(4096, hidden, scale=0.03), rand(hidden, 2048, scale=0.03),
                                rand(2 * inter, hidden, scale=0.03), rand(hidden, inter, scale=0.03))
    fp8 = fp8_supported(torch.device("cuda"))
    q8, s8 = quantize_per_channel(rand(2048, hidden, scale=0.03))

    def chain(x, res):
        h, res = rmsnorm(x, nw, 1e-6, res)
        qkv = gemv(h, w_qkv, config_for(*w_qkv.shape))
        o = gemv(qkv[:, :2048], w_o, config_for(*w_o.shape))
        gu, res = norm_gemv(o, res, nw, 1e-6, w_gu, config_for(*w_gu.shape))
        y = gemv(gu, w_down, config_for(*w_down.shape), silu=True)
        return fp8_gemv(y, q8, s8, None, fp8_gemv_config(*q8.shape)) if fp8 else y

    x, res = rand(1, hidden), rand(1, hidden)
    was = set_pdl(False)
    try:
        want = chain(x, res)
        set_pdl(True)
        sm90 = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl(x)["launch_pdl"] == pdl(rand(PDL_MAX_ROWS, hidden))["launch_pdl"] == sm90
        assert not pdl(rand(PDL_MAX_ROWS + 1, hidden))["launch_pdl"]  # a few rows only
        assert torch.equal(chain(x, res), want)
        sx, sres = x.clone(), res.clone()
        chain(sx, sres)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(sx, sres)
        for _ in range(3):
            x, res = rand(1, hidden), rand(1, hidden)
            set_pdl(False)
            want = chain(x, res)
            sx.copy_(x)
            sres.copy_(res)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    finally:
        set_pdl(was)


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 1000)])  # N, K
def test_norm_gemv_triton_matches_reference(with_residual, shape):
    from kernels.gemv import norm_gemv, norm_gemv_reference
    n, k = shape
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    want, want_res = norm_gemv_reference(x, res, nw, 1e-6, w)
    for cfg in GEMV_CONFIGS:
        got, got_res = norm_gemv(x, res, nw, 1e-6, w, cfg)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 5e-3, cfg
        assert torch.equal(got_res, want_res)
