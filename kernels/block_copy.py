"""Copy whole KV blocks between caches (or staging buffers) by block id, in one kernel.

A cache is indexed ``[layers, num_blocks, ...]`` with each (layer, block) chunk contiguous, in
either memory order (layer-major, or block-major seen through a transposed view). ``copy_blocks``
writes chunk ``(l, src_ids[i])`` of ``src`` into chunk ``(l, dst_ids[i])`` of ``dst`` for every
layer: each byte is read once and written once, with no staging, whatever the block ids. ``dst``
may live in another process (opened through CUDA IPC) or on a peer GPU. Gathering into a packed
buffer is ``dst_ids = arange(n)``; scattering from one is ``src_ids = arange(n)``.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                          dst_ids: torch.Tensor) -> None:
    dst.index_copy_(1, dst_ids.to(dst.device), src.index_select(1, src_ids.to(src.device))
                    .to(dst.device))


if triton is not None:
    @triton.jit
    def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, chunk,
                            src_layer_stride, src_block_stride, dst_layer_stride,
                            dst_block_stride, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        s = tl.load(src_ids_ptr + i).to(tl.int64)
        d = tl.load(dst_ids_ptr + i).to(tl.int64)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < chunk
        x = tl.load(src_ptr + layer * src_layer_stride + s * src_block_stride + offs, mask=mask)
        tl.store(dst_ptr + layer * dst_layer_stride + d * dst_block_stride + offs, x, mask=mask)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor, block: int = 4096) -> None:
    """Launch on the current stream of ``src``'s device (whichever device is current: a
    tensor-parallel replica's rank 0 moves its other ranks' caches too); ids are int64 tensors
    on that device."""
    n = src_ids.numel()
    if n == 0:
        return
    if triton is None or not src.is_cuda:
        copy_blocks_reference(src, dst, src_ids, dst_ids)
        return
    if src.dtype != dst.dtype or src.shape[2:] != dst.shape[2:] or src.shape[0] != dst.shape[0]:
        raise ValueError(f"copy_blocks: caches differ ({src.dtype}{tuple(src.shape)} vs "
                         f"{dst.dtype}{tuple(dst.shape)})")
    if not (src[0, 0].is_contiguous() and dst[0, 0].is_contiguous()):
        raise ValueError("copy_blocks: each (layer, block) chunk must be contiguous")
    chunk = src[0, 0].numel()
    grid = (n, src.shape[0], triton.cdiv(chunk, block))
    with torch.cuda.device(src.device):  # Triton launches on the current device
        _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, chunk, src.stride(0),
                                  src.stride(1), dst.stride(0), dst.stride(1), BLOCK=block)
