"""Qwen3's attention prologue in one kernel: q/k RMSNorm per head, neox RoPE, and the K/V store.

Input is the packed QKV projection ``[T, (Hq + 2 Hk) * D]``. Output is the rotated query
``[T, Hq, D]``; the rotated keys and the values go straight into the paged cache at
``slot_mapping`` (slots < 0 skipped). The reference is the unfused torch path: the same
RMSNorm as :mod:`kernels.norm`, RoPE in the activation dtype with cos/sin from a float32
cache ``[max_positions, D]`` (cos in the first half, sin in the second), then
:func:`kernels.kv_store.store_kv_reference`.
"""

from __future__ import annotations

import torch

from kernels._triton import pdl, tl, triton, use_triton, wait_for_inputs
from kernels.kv_store import store_kv_reference
from kernels.norm import rmsnorm_reference


def rope_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cos_sin: torch.Tensor):
    """``q``: ``[T, Hq, D]``, ``k``: ``[T, Hk, D]``; rotated in their own dtype."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def qk_norm_rope_store_reference(qkv, positions, q_weight, k_weight, eps, cos_sin, kv_cache,
                                 slot_mapping, num_heads: int, num_kv_heads: int,
                                 k_scale: float = 1.0, v_scale: float = 1.0):
    d = q_weight.numel()
    q, k, v = qkv.split((num_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
    q = rmsnorm_reference(q.reshape(-1, num_heads, d), q_weight, eps)
    k = rmsnorm_reference(k.reshape(-1, num_kv_heads, d), k_weight, eps)
    q, k = rope_reference(positions, q, k, cos_sin)
    store_kv_reference(k, v.reshape(-1, num_kv_heads, d), kv_cache, slot_mapping, k_scale,
                       v_scale)
    return q


if triton is not None:
    @triton.jit
    def _slots(slot_ptr, t, valid, block_size, c_stride_b, c_stride_s):
        """Which of the tokens ``t`` are stored (slot >= 0) and their offsets in a layer's
        cache (page and place in it)."""
        slot = tl.load(slot_ptr + t, mask=valid, other=-1).to(tl.int64)
        page = (slot // block_size) * c_stride_b + (slot % block_size) * c_stride_s
        return (slot >= 0)[:, None], page[:, None]

    @triton.jit
    def _as_cached(x, cache_ptr, inv_scale, FP8_CACHE: tl.constexpr):
        """``x`` as the cache stores it: in an FP8 cache, over the layer's scale, saturated, as
        e4m3."""
        if FP8_CACHE:
            y = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
            y = y.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            y = x.to(cache_ptr.dtype.element_ty)
        return y

    # One compiled kernel for every step's token count (a count Triton specialised on, as it
    # does an int divisible by 16, would compile a second one in the middle of serving).
    @triton.jit(do_not_specialize=["num_tokens"])
    def _qk_norm_rope_store_kernel(
            qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cs_ptr, cache_ptr, slot_ptr, q_out_ptr,
            num_tokens, qkv_stride, eps, block_size, c_stride_b, c_stride_kv, c_stride_h,
            c_stride_s, inv_k_scale, inv_v_scale, NUM_HEADS: tl.constexpr,
            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
            BLOCK_T: tl.constexpr, FP8_CACHE: tl.constexpr, PDL: tl.constexpr):
        """A program: ``BLOCK_T`` tokens' one head (a query, key or value head)."""
        wait_for_inputs(PDL)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1)
        valid = t < num_tokens
        rows = valid[:, None]
        i = tl.arange(0, HALF)[None, :]
        src = qkv_ptr + t[:, None] * qkv_stride + h * HEAD_DIM
        if h < NUM_HEADS + NUM_KV_HEADS:
            a = tl.load(src + i, mask=rows, other=0.0)
            dtype = a.dtype
            x1 = a.to(tl.float32)
            x2 = tl.load(src + HALF + i, mask=rows, other=0.0).to(tl.float32)
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
                            + eps)[:, None]
            if h < NUM_HEADS:
                w1 = tl.load(qw_ptr + i).to(tl.float32)
                w2 = tl.load(qw_ptr + HALF + i).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + i).to(tl.float32)
                w2 = tl.load(kw_ptr + HALF + i).to(tl.float32)
            n1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            n2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
            pos = tl.load(pos_ptr + t, mask=valid, other=0).to(tl.int64)[:, None]
            cos = tl.load(cs_ptr + pos * HEAD_DIM + i, mask=rows, other=0.0)
            sin = tl.load(cs_ptr + pos * HEAD_DIM + HALF + i, mask=rows, other=0.0)
            cos = cos.to(dtype).to(tl.float32)
            sin = sin.to(dtype).to(tl.float32)
            o1 = (n1 * cos - n2 * sin).to(dtype)
            o2 = (n2 * cos + n1 * sin).to(dtype)
            if h < NUM_HEADS:
                q_dst = q_out_ptr + (t[:, None] * NUM_HEADS + h) * HEAD_DIM
                tl.store(q_dst + i, o1, mask=rows)
                tl.store(q_dst + HALF + i, o2, mask=rows)
            else:
                stored, page = _slots(slot_ptr, t, valid, block_size, c_stride_b, c_stride_s)
                k_dst = cache_ptr + page + (h - NUM_HEADS) * c_stride_h
                tl.store(k_dst + i, _as_cached(o1, cache_ptr, inv_k_scale, FP8_CACHE),
                         mask=stored)
                tl.store(k_dst + HALF + i, _as_cached(o2, cache_ptr, inv_k_scale, FP8_CACHE),
                         mask=stored)
        else:
            d = tl.arange(0, HEAD_DIM)[None, :]
            stored, page = _slots(slot_ptr, t, valid, block_size, c_stride_b, c_stride_s)
            v_dst = cache_ptr + page + c_stride_kv \
                + (h - NUM_HEADS - NUM_KV_HEADS) * c_stride_h
            v = tl.load(src + d, mask=stored)
            tl.store(v_dst + d, _as_cached(v, cache_ptr, inv_v_scale, FP8_CACHE), mask=stored)


def tile_for(num_tokens: int) -> tuple[int, int]:
    """(tokens a program, warps) for a step of ``num_tokens``: a token a program (one warp) up
    to :data:`ONE_TOKEN_MAX`, else :data:`TILE`."""
    return (1, 1) if num_tokens <= ONE_TOKEN_MAX else TILE


# Measured on the H100 (docs/benchmarks.md, "The attention prologue in tiles of tokens"): a token
# a program was the fastest to 8 tokens; from 16 to 4,096, 8 tokens x 4 warps was the fastest
# or within 1.3% of it (a token a program moved 0.8 TB/s at 1,024 tokens x 48 heads, 31 µs a
# layer; the tiles 3.4 TB/s, 7.3 µs).
ONE_TOKEN_MAX = 8
TILE = (8, 4)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                       num_kv_heads: int, k_scale: float = 1.0, v_scale: float = 1.0,
                       out: torch.Tensor | None = None,
                       tile: tuple[int, int] | None = None) -> torch.Tensor:
    """Returns the rotated query ``[T, Hq, D]`` (written into ``out`` when given, contiguous)
    and stores K/V (an FP8 cache: divided by the layer's ``k_scale``/``v_scale``); see the
    module docstring. ``tile``: (tokens a program, warps), :func:`tile_for`'s by default."""
    d = q_weight.numel()
    if (not use_triton(qkv) or d & (d - 1) or d < 2 or qkv.stride(1) != 1
            or kv_cache.stride(4) != 1 or q_weight.dtype != qkv.dtype):
        q = qk_norm_rope_store_reference(qkv, positions, q_weight, k_weight, eps, cos_sin,
                                         kv_cache, slot_mapping, num_heads, num_kv_heads,
                                         k_scale, v_scale)
        return q if out is None else out.copy_(q)
    t = qkv.shape[0]
    q = out if out is not None else torch.empty((t, num_heads, d), dtype=qkv.dtype,
                                                device=qkv.device)
    if t:
        block_t, warps = tile or tile_for(t)
        _qk_norm_rope_store_kernel[(triton.cdiv(t, block_t), num_heads + 2 * num_kv_heads)](
            qkv, positions, q_weight, k_weight, cos_sin, kv_cache, slot_mapping, q, t,
            qkv.stride(0), eps, kv_cache.shape[3], kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), kv_cache.stride(3), 1.0 / k_scale, 1.0 / v_scale,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, HALF=d // 2,
            BLOCK_T=block_t, FP8_CACHE=kv_cache.dtype == torch.float8_e4m3fn,
            num_warps=warps, **pdl(qkv))
    return q
