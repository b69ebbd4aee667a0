"""Triton, when installed and a GPU is there; CPU hosts run the torch references (and do not
import Triton at all: it comes with xgrammar's dependencies even on CPU installs).

Programmatic dependent launch (PDL, Hopper and newer): the decode chain's kernels are launched
so that each may start while the kernel before it is still finishing. A kernel so launched
first reads what no earlier kernel writes (its weights), then waits for the kernel before it
(:func:`wait_for_inputs`: ``griddepcontrol.wait``, which returns once that kernel has finished
and its writes are visible) and lets the next one launch. Each weight-streaming kernel's first
tile is thus in flight while the previous kernel drains, instead of after it. ``BATON_PDL=0``
turns it off (the kernels then launch as before; FlashInfer's own kernels keep their
``enable_pdl`` default). Only launches of a few rows use it (:func:`pdl`)."""

from __future__ import annotations

import functools
import os

import torch

triton = tl = None
# ``TRITON_INTERPRET=1`` (Triton's interpreter, numpy on the CPU) imports Triton on a CPU host too,
# so tests can run a kernel on CPU tensors (float16 and FP8: the interpreter misreads bfloat16).
# The engine still never launches one there: :func:`use_triton` wants CUDA tensors.
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = tl = None

_PDL_WANTED = os.environ.get("BATON_PDL", "1") != "0"
# Rows up to which kernels launch under PDL (H100, decode graphs of 1-16 rows: 8B FP8 4% faster
# a step from 2 to 16 rows, 8B bf16 0.4-1.5%, 0.6B bf16 1.5-2.4% at 2-4 rows but 2.8% slower at
# 16; prefill and batches of 256 1-6% slower).
PDL_MAX_ROWS = 8

if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - Triton before 3.4
        _PDL_WANTED = False

        @triton.jit
        def gdc_wait():
            pass

        @triton.jit
        def gdc_launch_dependents():
            pass

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Under PDL: wait until the kernel before has finished (its writes visible), then let
        the next kernel launch. Nothing the kernels before write may be read or written ahead
        of this call; weights may."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    wait_for_inputs = None


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


@functools.cache
def _pdl_on(device_index: int) -> bool:
    return _PDL_WANTED and torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl(x: torch.Tensor) -> dict:
    """Launch options of a kernel that calls :func:`wait_for_inputs`, whose rows are ``x``'s:
    ``PDL`` (its constexpr) and Triton's ``launch_pdl``. On up to :data:`PDL_MAX_ROWS` rows (a
    small batch's decode step, a chain of short kernels: one row measured 4-18% faster a step
    on the H100); at more rows (prefill, large batches) it measured slower, so those launch as
    before."""
    on = x.is_cuda and x.shape[0] <= PDL_MAX_ROWS and _pdl_on(
        x.device.index if x.device.index is not None else torch.cuda.current_device())
    return {"PDL": on, "launch_pdl": on}


def set_pdl(on: bool) -> bool:
    """Turn PDL on or off for the launches that follow (benchmarks' A/B; a graph captured
    before keeps what it was captured with); returns what it was."""
    global _PDL_WANTED
    was, _PDL_WANTED = _PDL_WANTED, on
    _pdl_on.cache_clear()
    return was


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 256))
