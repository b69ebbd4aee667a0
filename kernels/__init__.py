"""Baton's kernels. Each op has a plain-torch reference (the CPU path, and what the Triton
kernel is tested against); the Triton kernel replaces it on CUDA."""

from kernels.activation import silu_and_mul, silu_and_mul_reference
from kernels.block_copy import copy_blocks, copy_blocks_reference
from kernels.kv_store import store_kv_reference
from kernels.norm import rmsnorm, rmsnorm_reference
from kernels.rope import (qk_norm_rope_store, qk_norm_rope_store_reference, rope_reference)

__all__ = ["copy_blocks", "copy_blocks_reference", "qk_norm_rope_store",
           "qk_norm_rope_store_reference", "rmsnorm", "rmsnorm_reference", "rope_reference",
           "silu_and_mul", "silu_and_mul_reference", "store_kv_reference"]
