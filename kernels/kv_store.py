"""Write new K/V rows into the paged cache by slot mapping; slots < 0 are skipped.

Cache layout per layer (HND): ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``; index 0 of
dim 1 is K, 1 is V. A slot is ``block_id * block_size + offset``. The block stride may be larger
than one block (the engine's cache is block-major across layers). This is the torch path; on
CUDA the store is fused into :func:`kernels.rope.qk_norm_rope_store`.
"""

from __future__ import annotations

import torch


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values as the cache stores them: divided by the layer's scale and rounded (saturating at
    ±448) when the cache is FP8 e4m3; cast otherwise."""
    if dtype == torch.float8_e4m3fn:
        fmax = torch.finfo(dtype).max
        return (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return x.to(dtype)


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    """``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]``; ``kv_cache``: one layer's cache.
    An FP8 cache holds ``k / k_scale`` and ``v / v_scale``."""
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # Advanced indices around a slice: the result is [num_tokens, num_kv_heads, head_dim].
    kv_cache[blocks, 0, :, offsets, :] = to_cache_dtype(k, kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, :, offsets, :] = to_cache_dtype(v, kv_cache.dtype, v_scale)
