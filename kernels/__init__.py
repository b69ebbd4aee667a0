"""Baton's kernels. Each op has a plain-torch reference (used on CPU); Triton versions replace
them on CUDA where they pay (see ``kernels/kv_store.py``)."""

from kernels.block_copy import copy_blocks, copy_blocks_reference
from kernels.kv_store import store_kv, store_kv_reference

__all__ = ["copy_blocks", "copy_blocks_reference", "store_kv", "store_kv_reference"]
