"""Write new K/V rows into the paged cache by slot mapping; slots < 0 are skipped.

Cache layout per layer (HND): ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``; index 0 of
dim 1 is K, 1 is V. A slot is ``block_id * block_size + offset``. The block stride may be larger
than one block (the engine's cache is block-major across layers), so the kernel takes strides.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton, use_triton


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]``; ``kv_cache``: one layer's cache."""
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # Advanced indices around a slice: the result is [num_tokens, num_kv_heads, head_dim].
    kv_cache[blocks, 0, :, offsets, :] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, :, offsets, :] = v.to(kv_cache.dtype)


if triton is not None:
    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_stride_t, k_stride_h, v_stride_t,
                         v_stride_h, c_stride_b, c_stride_kv, c_stride_h, c_stride_s,
                         block_size, HEAD_DIM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, HEAD_DIM)
            dst = cache_ptr + (slot // block_size) * c_stride_b + h * c_stride_h \
                + (slot % block_size) * c_stride_s + d
            k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d)
            v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d)
            tl.store(dst, k.to(cache_ptr.dtype.element_ty))
            tl.store(dst + c_stride_kv, v.to(cache_ptr.dtype.element_ty))


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Dispatch: the Triton kernel on CUDA (no host sync, so CUDA-graph safe), else the
    reference."""
    head_dim = k.shape[-1]
    if not use_triton(kv_cache) or head_dim & (head_dim - 1) or k.stride(2) != 1 \
            or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        store_kv_reference(k, v, kv_cache, slot_mapping)
        return
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0], k.shape[1])](
            k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            kv_cache.shape[3], HEAD_DIM=head_dim, num_warps=1)
