"""Each row's argmax over a vocabulary of logits, in one launch.

``torch.argmax`` of one float32 row of Qwen3's 151,936 logits takes 8.6 us on an H100 (a
reduction kernel with few blocks a row; docs/benchmarks.md), about 1% of a 0.6B decode step.
Here a program takes one ``BLOCK`` of a row (the row is spread over the whole GPU), writes
its largest value and that value's first column, and the row's last program to finish (a
counter a row, as ``kernels.decode_attention`` merges its splits) takes the partials in order
and writes the row's result. The first column of the largest value wins, as with
``torch.argmax``; a NaN counts as larger than any number (torch returns a NaN's column; here
that holds where the row has no +inf).

With ``draw`` the rows whose inverse temperature is above zero are sampled instead, by the
Gumbel-max trick: the argmax of ``logits / T + g``, ``g = -log(-log(u))`` for ``u`` uniform,
draws a column with probability ``softmax(logits / T)`` (the exponential race the sampler runs,
``probs / q`` with ``q = -log(u)``, in logarithms). ``u`` comes from Philox keyed by the row's
salt and position (``tl.rand``), so a sequence's draw at a position is the same whatever the
batch, and no generator's state lives on the host. Rows at zero take the plain argmax.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton, use_triton

BLOCK = 2048  # columns a program takes (float32: 8 KiB)
NUM_WARPS = 4


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def draw_reference(x: torch.Tensor, inv_temp: torch.Tensor, salt: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """What the kernel's ``draw`` computes, with torch's generator for Philox's numbers (the
    same distribution, not the same draws): row ``r`` at ``inv_temp[r] > 0`` is sampled from
    ``softmax(x[r] * inv_temp[r])`` with noise keyed by ``salt[r]`` and ``positions[r]``."""
    out = x.argmax(dim=-1)
    for r in range(x.shape[0]):
        it = float(inv_temp[r])
        if it > 0:
            gen = torch.Generator(device=x.device).manual_seed(
                (int(salt[r]) << 32) | int(positions[r]) & 0xFFFFFFFF)
            q = torch.empty(x.shape[1], device=x.device).exponential_(generator=gen)
            out[r] = (x[r].float() * it - q.log()).argmax()
    return out


if triton is not None:
    @triton.jit
    def _argmax_kernel(x_ptr, stride, n, part_val_ptr, part_idx_ptr, count_ptr, out_ptr,
                       host_ptr, temp_ptr, salt_ptr, pos_ptr, CHUNKS: tl.constexpr,
                       CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr, HOST: tl.constexpr,
                       DRAW: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        v = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=live,
                    other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN: larger than any number
        if DRAW:
            inv_temp = tl.load(temp_ptr + row)
            if inv_temp > 0:  # a sampled row: Philox keyed (salt, position), a number a column
                key = tl.load(salt_ptr + row).to(tl.int64) * 4294967296 + \
                    (tl.load(pos_ptr + row) & 0xFFFFFFFF)
                u = tl.rand(key, cols)
                v = v * inv_temp - tl.log(-tl.log(u))
        top = tl.max(v, axis=0)
        first = tl.min(tl.where((v == top) & live, cols, n), axis=0)
        base = row * CHUNKS
        tl.store(part_val_ptr + base + chunk, top)
        tl.store(part_idx_ptr + base + chunk, first)
        tl.debug_barrier()  # the partials written before the count
        counter = count_ptr + row
        if tl.atomic_add(counter, 1, sem="acq_rel") == CHUNKS - 1:
            ks = tl.arange(0, CHUNKS_P2)
            vals = tl.load(part_val_ptr + base + ks, mask=ks < CHUNKS, other=float("-inf"),
                           cache_modifier=".cg")
            idx = tl.load(part_idx_ptr + base + ks, mask=ks < CHUNKS, other=n,
                          cache_modifier=".cg")
            best = tl.max(vals, axis=0)
            winner = tl.min(tl.where(vals == best, idx, n), axis=0).to(tl.int64)
            tl.store(out_ptr + row, winner)
            if HOST:  # (pinned host memory, written across the bus)
                tl.store(host_ptr + row, winner)
            tl.atomic_xchg(counter, 0)


class RowArgmax:
    """``torch.argmax(x, -1)`` of a ``[rows, n]`` tensor as one launch on CUDA (the torch
    reference elsewhere). Holds its partials and counters (grown on demand); the counters return
    to zero after every launch. One instance serves one stream: launches of one instance on two
    streams at once would share counters (an engine samples on its one stream)."""

    def __init__(self):
        self._rows = 0
        self._chunks = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _workspace(self, rows: int, chunks: int, device: torch.device):
        if self._buffers is None or rows > self._rows or chunks > self._chunks \
                or self._buffers[2].device != device:
            self._rows, self._chunks = max(rows, self._rows), max(chunks, self._chunks)
            size = self._rows * self._chunks
            self._buffers = (torch.empty(size, dtype=torch.float32, device=device),
                             torch.empty(size, dtype=torch.int32, device=device),
                             torch.zeros(self._rows, dtype=torch.int32, device=device))
        return self._buffers

    def reserve(self, rows: int, n: int, device: torch.device) -> None:
        """Hold the workspace of ``[rows, n]`` inputs now (a CUDA graph captures its buffers:
        they must not be grown after it)."""
        if triton is not None:
            self._workspace(rows, triton.cdiv(n, BLOCK), device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 host: torch.Tensor | None = None,
                 draw: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """``out``: an int64 ``[rows]`` tensor to write into (a graph's static buffer); ``host``:
        one more, in pinned host memory, written by the kernel itself (no copy queued);
        ``draw``: ``(inv_temp, salt, positions)``, float32, int32 and int64 ``[rows]`` on the
        device: the rows whose inverse temperature is above zero are sampled
        (:func:`draw_reference`)."""
        if not use_triton(x) or x.dim() != 2 or x.stride(-1) != 1 or not x.shape[0] \
                or x.shape[1] >= 2 ** 31:
            ref = argmax_reference(x) if draw is None else draw_reference(x, *draw)
            if host is not None:
                host.copy_(ref)
            return ref if out is None else out.copy_(ref)
        rows, n = x.shape
        chunks = triton.cdiv(n, BLOCK)
        part_val, part_idx, counters = self._workspace(rows, chunks, x.device)
        if out is None:
            out = torch.empty(rows, dtype=torch.int64, device=x.device)
        _argmax_kernel[(rows, chunks)](
            x, x.stride(0), n, part_val, part_idx, counters, out,
            out if host is None else host, *(draw or (x, out, out)), CHUNKS=chunks,
            CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK=BLOCK, HOST=host is not None,
            DRAW=draw is not None, num_warps=NUM_WARPS)
        return out
