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

A sampled row may also be cut to its ``top_k`` most likely columns (``top_k`` at most
``TOP_K_MAX``) and then to ``top_p`` of their mass (:func:`cut_reference`, the sampler's rule:
every column as likely as the k-th stays, and a column stays where the columns more likely
than it hold less than ``top_p``). Each program then also keeps its block's ``TOP_K_MAX``
largest values (``tl.topk`` of keys packing value and column) with their Gumbel scores, and
the row's last program ranks those candidates (merging the blocks' sorted lists), finds the
k-th value and the top-p floor among the first ``top_k``, and takes the best score at or above
the floor. A block whose candidates all tie with the k-th value may hold more of those ties;
that rare block is read again.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton, use_triton

BLOCK = 2048  # columns a program takes (float32: 8 KiB)
NUM_WARPS = 4
# A cut draw of up to CUT_FEW_ROWS rows runs CUT_FEW_WARPS a program: its blocks' top-k and the
# merge gain from them (H200, 151,936 columns: 22.8 us against 33.8 at one row, 40.4 against
# 45.0 at four, 58.4 against 59.5 at eight), where more rows lose (182 against 147 at 32).
CUT_FEW_ROWS, CUT_FEW_WARPS = 8, 8
TOP_K_MAX = 32  # the largest top-k a draw cuts to (a power of two; rows past it: the sampler)


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def cut_reference(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Which columns of one row of temperature-scaled logits ``z`` a draw keeps: those at
    least as large as the ``top_k``-th largest (``top_k`` <= 0: all), then, with ``top_p`` < 1,
    those whose larger kept values hold less than ``top_p`` of the kept columns' probability
    (ties stay or go together; the largest always stays)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep = z >= z.topk(top_k).values[-1]
    if top_p < 1:
        probs = torch.softmax(z.float().masked_fill(~keep, float("-inf")), -1)
        values, group = torch.unique(z[keep], sorted=True, return_inverse=True)
        mass = torch.zeros(len(values), dtype=probs.dtype, device=z.device).index_add_(
            0, group, probs[keep])
        above = mass.flip(0).cumsum(0).flip(0) - mass  # the mass of the larger values
        stays = (above < top_p) & (values > float("-inf"))
        stays[-1] = True
        keep &= z >= values[stays].min()
    return keep


def draw_reference(x: torch.Tensor, inv_temp: torch.Tensor, salt: torch.Tensor,
                   positions: torch.Tensor, top_k: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel's ``draw`` computes, with torch's generator for Philox's numbers (the
    same distribution, not the same draws): row ``r`` at ``inv_temp[r] > 0`` is sampled from
    ``softmax(x[r] * inv_temp[r])`` over the columns :func:`cut_reference` keeps at
    ``top_k[r]`` and ``top_p[r]``, with noise keyed by ``salt[r]`` and ``positions[r]``."""
    out = x.argmax(dim=-1)
    for r in range(x.shape[0]):
        it = float(inv_temp[r])
        if it > 0:
            # (a CPU generator keeps 32 bits of its seed: the key's two halves mixed into them)
            gen = torch.Generator(device=x.device).manual_seed(
                hash((int(salt[r]), int(positions[r]) & 0xFFFFFFFF)) & 0xFFFFFFFF)
            q = torch.empty(x.shape[1], device=x.device).exponential_(generator=gen)
            z = x[r].float() * it
            if top_k is not None:
                z = z.masked_fill(~cut_reference(z, int(top_k[r]), float(top_p[r])),
                                  float("-inf"))
            out[r] = (z - q.log()).argmax()
    return out


if triton is not None:
    @triton.jit
    def _pack(v, cols):
        """Keys ordering (value, then the first column) as int64, largest first."""
        bits = v.to(tl.int32, bitcast=True)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return bits.to(tl.int64) * 4294967296 + (0x7FFFFFFF - cols).to(tl.int64)

    @triton.jit
    def _unpack(keys, n):
        """Values and columns of :func:`_pack`'s keys (-inf and ``n`` where no column)."""
        bits = (keys >> 32).to(tl.int32)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        cols = (0x7FFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int32)
        live = cols < n
        return tl.where(live, bits.to(tl.float32, bitcast=True), float("-inf")), \
            tl.where(live, cols, n)

    @triton.jit
    def _gumbel(v, inv_temp, key, cols):
        return v * inv_temp - tl.log(-tl.log(tl.rand(key, cols)))

    @triton.jit
    def _top_of_sorted(keys, LEVELS: tl.constexpr, KEEP: tl.constexpr):
        """The ``KEEP`` largest of ``keys`` (``[2 ** LEVELS, KEEP]``, each row sorted, the even
        rows one way and the odd ones the other), largest first. Triton's bitonic top-k
        (``tl.topk``) without its sorts: a level takes the larger of each pair of rows, the
        top ``KEEP`` of both as a bitonic row, and merges it (odd rows the other way again)."""
        h = keys
        for i in tl.static_range(LEVELS):
            h = tl.max(tl.reshape(h, [(1 << (LEVELS - i - 1)), 2, KEEP]), axis=1)
            h = tl.bitonic_merge(h, descending=2 if i < LEVELS - 1 else 1)
        return tl.reshape(h, [KEEP])

    @triton.jit
    def _cut_draw(x_ptr, stride, n, key_ptr, score_ptr, row, inv_temp, top_k, top_p, key,
                  CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr,
                  KEEP: tl.constexpr, LEVELS: tl.constexpr):
        """A row cut to its ``top_k`` (at most ``KEEP``) and ``top_p``, drawn from the blocks'
        candidates (each block's ``KEEP`` largest, with their Gumbel scores): the column."""
        chunk = tl.arange(0, CHUNKS_P2)[:, None]
        at = (row * CHUNKS + chunk) * KEEP + tl.arange(0, KEEP)[None, :]
        keys = tl.load(key_ptr + at, mask=chunk < CHUNKS, other=-9223372036854775808,
                       cache_modifier=".cg")
        scores = tl.load(score_ptr + at, mask=chunk < CHUNKS, other=float("-inf"),
                         cache_modifier=".cg")
        v, cols = _unpack(keys, n)
        ranked, ranked_cols = _unpack(_top_of_sorted(keys, LEVELS, KEEP), n)
        rank = tl.arange(0, KEEP)
        kth = tl.max(tl.where(rank == top_k - 1, ranked, float("-inf")), axis=0)
        top = tl.max(ranked, axis=0)
        # A block whose KEEP candidates all reach the k-th value may hold more of its ties:
        # counted and drawn from its columns themselves (rare: KEEP - top_k + 1 ties in a block).
        low = tl.min(v, axis=1)
        full = (low == kth) & (low > float("-inf"))
        extra = 0
        tie_best = float("-inf")
        tie_col = n
        if tl.sum(full.to(tl.int32), axis=0) > 0:
            for c in range(CHUNKS):
                if tl.sum(tl.where(tl.arange(0, CHUNKS_P2) == c, full, False).to(tl.int32),
                          axis=0) > 0:
                    cc = c * BLOCK + tl.arange(0, BLOCK)
                    cv = tl.load(x_ptr + row.to(tl.int64) * stride + cc, mask=cc < n,
                                 other=float("-inf")).to(tl.float32)
                    cv = tl.where(cv != cv, float("inf"), cv)
                    tie = (cv == kth) & (cc < n)
                    extra += tl.sum(tie.to(tl.int32), axis=0) - tl.sum(tl.sum(
                        ((chunk == c) & (v == kth)).to(tl.int32), axis=1), axis=0)
                    s = tl.where(tie, _gumbel(cv, inv_temp, key, cc), float("-inf"))
                    best = tl.max(s, axis=0)
                    col = tl.min(tl.where((s == best) & tie, cc, n), axis=0)
                    if (best > tie_best) | ((best == tie_best) & (col < tie_col)):
                        tie_best = best
                        tie_col = col
        # top-p over the top-k set (ties included): the floor is the value of the last column
        # ranked with less than top_p of the set's mass ahead of it (its ties stay too)
        mass = tl.sum(tl.sum(tl.where(v >= kth, tl.exp((v - top) * inv_temp), 0.0), axis=1),
                      axis=0) + extra * tl.exp((kth - top) * inv_temp)
        kept = (ranked >= kth) & (ranked > float("-inf"))
        p = tl.where(kept, tl.exp((ranked - top) * inv_temp) / mass, 0.0)
        ahead = tl.cumsum(p, axis=0) - p
        last = tl.maximum(tl.sum((kept & (ahead < top_p)).to(tl.int32), axis=0), 1) - 1
        floor = tl.where(top_p < 1,
                         tl.max(tl.where(rank == last, ranked, float("-inf")), axis=0), kth)
        taken = (v >= floor) & (cols < n) & ~(full[:, None] & (v == kth))
        s = tl.where(taken, scores, float("-inf"))
        best = tl.max(tl.max(s, axis=1), axis=0)
        col = tl.min(tl.min(tl.where((s == best) & taken, cols, n), axis=1), axis=0)
        if (floor == kth) & ((tie_best > best) | ((tie_best == best) & (tie_col < col))):
            best = tie_best
            col = tie_col
        first = tl.min(tl.where(rank == 0, ranked_cols, n), axis=0)
        # +inf logits, or nothing drawable: the first column of the largest value (the argmax)
        return tl.where((top == float("inf")) | (best == float("-inf")), first, col)

    @triton.jit
    def _argmax_kernel(x_ptr, stride, n, part_val_ptr, part_idx_ptr, count_ptr, out_ptr,
                       host_ptr, temp_ptr, salt_ptr, pos_ptr, top_k_ptr, top_p_ptr, key_ptr,
                       score_ptr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                       BLOCK: tl.constexpr, HOST: tl.constexpr, DRAW: tl.constexpr,
                       KEEP: tl.constexpr, LEVELS: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        v = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=live,
                    other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN: larger than any number
        if DRAW:
            inv_temp = tl.load(temp_ptr + row)
            key = tl.load(salt_ptr + row).to(tl.int64) * 4294967296 + \
                (tl.load(pos_ptr + row).to(tl.int64) & 0xFFFFFFFF)
            if KEEP:  # (a constant: no top-k machinery compiled in without it)
                cut = (inv_temp > 0) & (tl.load(top_k_ptr + row) > 0)
                if cut:  # cut to its top k: the block's KEEP largest, with their scores
                    keys = tl.topk(tl.where(live, _pack(v, cols), -9223372036854775808), KEEP)
                    kv, kc = _unpack(keys, n)
                    # (an odd block's in reverse: the merge takes rows sorted each way in turn)
                    rank = tl.arange(0, KEEP)
                    at = (row * CHUNKS + chunk) * KEEP + tl.where(chunk % 2 == 1, KEEP - 1 - rank,
                                                                  rank)
                    tl.store(key_ptr + at, keys)
                    tl.store(score_ptr + at, _gumbel(kv, inv_temp, key, kc))
                elif inv_temp > 0:
                    v = _gumbel(v, inv_temp, key, cols)
            elif inv_temp > 0:  # a sampled row: Philox keyed (salt, position), a number a column
                v = _gumbel(v, inv_temp, key, cols)
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
            winner = tl.min(tl.where(vals == best, idx, n), axis=0)
            if KEEP:
                if cut:
                    winner = _cut_draw(x_ptr, stride, n, key_ptr, score_ptr, row, inv_temp,
                                       tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), key,
                                       CHUNKS, CHUNKS_P2, BLOCK, KEEP, LEVELS)
            winner = winner.to(tl.int64)
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
        self._cut: tuple[torch.Tensor, torch.Tensor] | None = None

    def _workspace(self, rows: int, chunks: int, device: torch.device, cut: bool = False):
        if self._buffers is None or rows > self._rows or chunks > self._chunks \
                or self._buffers[2].device != device:
            self._rows, self._chunks = max(rows, self._rows), max(chunks, self._chunks)
            size = self._rows * self._chunks
            self._buffers = (torch.empty(size, dtype=torch.float32, device=device),
                             torch.empty(size, dtype=torch.int32, device=device),
                             torch.zeros(self._rows, dtype=torch.int32, device=device))
            self._cut = None
        if cut and self._cut is None:  # (only for draws that cut: TOP_K_MAX a block)
            size = self._rows * self._chunks * TOP_K_MAX
            self._cut = (torch.empty(size, dtype=torch.int64, device=device),
                         torch.empty(size, dtype=torch.float32, device=device))
        return self._buffers

    def reserve(self, rows: int, n: int, device: torch.device, cut: bool = False) -> None:
        """Hold the workspace of ``[rows, n]`` inputs now (a CUDA graph captures its buffers:
        they must not be grown after it); ``cut``: with draws cut to a top-k."""
        if triton is not None:
            self._workspace(rows, triton.cdiv(n, BLOCK), device, cut)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 host: torch.Tensor | None = None,
                 draw: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """``out``: an int64 ``[rows]`` tensor to write into (a graph's static buffer); ``host``:
        one more, in pinned host memory, written by the kernel itself (no copy queued);
        ``draw``: ``(inv_temp, salt, positions)``, float32, int32 and int64 ``[rows]`` on the
        device, and optionally ``top_k`` and ``top_p`` (int32 and float32 ``[rows]``; ``top_k``
        at most ``TOP_K_MAX``, and ``top_p`` below 1 only with a ``top_k`` above 0): the rows
        whose inverse temperature is above zero are sampled (:func:`draw_reference`)."""
        if not use_triton(x) or x.dim() != 2 or x.stride(-1) != 1 or not x.shape[0] \
                or x.shape[1] >= 2 ** 31:
            ref = argmax_reference(x) if draw is None else draw_reference(x, *draw)
            if host is not None:
                host.copy_(ref)
            return ref if out is None else out.copy_(ref)
        rows, n = x.shape
        chunks = triton.cdiv(n, BLOCK)
        p2 = triton.next_power_of_2(chunks)
        cut = draw is not None and len(draw) == 5
        part_val, part_idx, counters = self._workspace(rows, chunks, x.device, cut)
        if out is None:
            out = torch.empty(rows, dtype=torch.int64, device=x.device)
        params = draw if cut else (draw or (x, out, out)) + (x, x)  # (unread where not drawn)
        _argmax_kernel[(rows, chunks)](
            x, x.stride(0), n, part_val, part_idx, counters, out,
            out if host is None else host, *params, *(self._cut if cut else (x, x)),
            CHUNKS=chunks, CHUNKS_P2=p2, LEVELS=p2.bit_length() - 1, BLOCK=BLOCK,
            HOST=host is not None, DRAW=draw is not None, KEEP=TOP_K_MAX if cut else 0,
            num_warps=CUT_FEW_WARPS if cut and rows <= CUT_FEW_ROWS else NUM_WARPS)
        return out
