"""Kernels against their torch references (the CPU path is the reference itself)."""

import pytest
import torch

from kernels import copy_blocks, copy_blocks_reference, store_kv, store_kv_reference


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
    store_kv(k, v, cache, torch.tensor([5, -1, 12]))
    want = torch.zeros_like(cache)
    want[1, 0, :, 1], want[1, 1, :, 1] = k[0], v[0]  # slot 5: block 1, offset 1
    want[3, 0, :, 0], want[3, 1, :, 0] = k[2], v[2]  # slot 12: block 3, offset 0
    assert torch.equal(cache, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_triton_matches_reference(dtype):
    _check_copy_blocks("cuda", dtype)


@pytest.mark.gpu
def test_store_kv_cuda_matches_reference():
    k, v = torch.randn(9, 2, 8, device="cuda"), torch.randn(9, 2, 8, device="cuda")
    slots = torch.tensor([0, 3, -1, 17, 40, -1, 95, 50, 64], device="cuda")
    cache = torch.zeros(6, 2, 2, 16, 8, device="cuda")
    ref = cache.clone()
    store_kv(k, v, cache, slots)
    store_kv_reference(k, v, ref, slots)
    assert torch.equal(cache, ref)
