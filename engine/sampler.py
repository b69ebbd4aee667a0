"""Batched sampling without a host sync per request.

Per step, for the sequences due a token: logits are changed where a request asks for it
(``logit_bias``, ``min_tokens``, repetition / frequency / presence penalties; see
:class:`~engine.sampling_params.SamplingParams`), greedy rows take the argmax, other rows are
scaled by temperature, cut by min-p, top-k and top-p, and sampled with the exponential trick
(``argmax(probs / q)``, ``q ~ Exp(1)``), drawing ``q`` from the engine's generator, or for a
request with a seed from its own generator seeded by (seed, position of the token being
sampled): a seeded request draws the same numbers however it is batched, split between a
prefill and a decode engine, or resumed on another replica with its tokens so far as the prompt.
Logprobs (and the top ``k``) are of the raw logits.

A step whose every row is greedy or unseeded, with no min-p and a top-k of at most
``TOP_K_MAX`` (with or without a top-p) or no cut at all, is drawn instead in one launch
(:class:`~kernels.argmax.RowArgmax`'s ``draw``, the kernel a decode graph draws with): Philox
numbers keyed by the sequence's salt and the position, the same distribution (the cut of
:func:`_apply_top_k_top_p`). The torch ops above cost the host ~1 ms a step on Qwen3's
vocabulary with a top-k and top-p (docs/benchmarks.md).

Per-row parameters go to the device without a host sync (:mod:`engine.uploads`), so sampling
queues behind the forward pass. The penalties count the tokens of each penalized row, uploaded
each step (prompt too for the repetition penalty); the newest output token may still be on the
device (the engine runs one step ahead): it is read from the running step's sampled ids there.
A step without any of these requests pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.sequence import PENDING, Sequence
from engine.structured import apply_bitmasks
from engine.uploads import upload
from kernels.argmax import TOP_K_MAX, RowArgmax

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for the token at ``position`` (its index in prompt +
    output): splitmix64 of the pair, so neighbouring positions and seeds draw unrelated noise."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Draw(NamedTuple):
    """How the one-launch draw (:class:`kernels.argmax.RowArgmax`'s ``draw``) takes a row's
    token: ``inv_temp`` 0 the argmax; else a draw at that inverse temperature with Philox keyed
    by ``salt`` and the row's position, cut to the row's ``top_k`` (0: none; at most
    ``TOP_K_MAX``) and ``top_p`` (below 1 only with a ``top_k``)."""

    inv_temp: float
    salt: int
    top_k: int = 0
    top_p: float = 1.0


GREEDY_DRAW = Draw(0.0, 0)


def pack_draws(draws: Seq[Draw]) -> torch.Tensor:
    """``draws`` as an int32 ``[4, len(draws)]`` host tensor, a row a field (the inverse
    temperatures and top-p float32 bits)."""
    host = torch.empty(4, len(draws), dtype=torch.int32)
    for i, field in enumerate(zip(*draws)):
        host[i].view(torch.float32 if i in (0, 3) else torch.int32).copy_(torch.tensor(field))
    return host


@dataclass
class SampleOutput:
    """One step's draws, on the device: ``tokens`` ``[B]``; with logprobs asked for by any row,
    the sampled tokens' ``logprobs`` ``[B]``, and with top logprobs the ``top_ids`` and
    ``top_logprobs`` ``[B, K]`` (``K`` the largest asked; rows use their first ``k``)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.seed = seed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.argmax = RowArgmax()  # rows' argmax, one launch on CUDA (on this engine's stream)

    def new_generator(self) -> torch.Generator:
        """A seeded request's generator (re-seeded for each draw by :func:`position_seed`)."""
        return torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence],
                 prev_tokens: torch.Tensor | None = None,
                 eos_ids: Iterable[int] = (), grammars=None) -> SampleOutput:
        """``logits``: ``[B, V]`` float32 of ``seqs`` (each due its token at position
        ``num_tokens``); ``prev_tokens``: the running step's sampled ids (where pending tokens
        live); ``eos_ids``: banned with ``stop_token_ids`` until ``min_tokens``; ``grammars``
        (:class:`~engine.structured.Grammars`): masks the rows whose sequence has a matcher."""
        params = [s.params for s in seqs]
        raw = logits
        matchers = {i: s.matcher for i, s in enumerate(seqs) if s.matcher is not None}
        masks = (list(matchers), grammars.bitmasks(len(seqs), matchers)) if matchers else None
        logits = processed(logits, seqs, prev_tokens, frozenset(eos_ids), masks)
        if all(p.greedy for p in params):
            tokens = self.argmax(logits)
        elif None not in (draws := [self.draw_of(s) for s in seqs]):
            tokens = self.argmax(logits, draw=self._draw_params(draws, [s.num_tokens - 1
                                                                        for s in seqs]))
        else:
            tokens = torch.where(self._greedy_mask(params, logits.device), self.argmax(logits),
                                 self._sample(logits, params, [s.generator for s in seqs],
                                              [s.num_tokens for s in seqs]))
        out = SampleOutput(tokens)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if asked:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            if max(asked):
                out.top_logprobs, out.top_ids = logprobs.topk(max(asked), dim=-1)
        return out

    def draw_of(self, seq: Sequence) -> Draw | None:
        """``seq``'s row of the one-launch draw, or None where its draw asks more: a seed (its
        own generator's numbers, whatever the batch), min-p, a top-k past ``TOP_K_MAX`` or a
        top-p without a top-k. A sampled sequence's salt is fixed for its life: its arrival
        order mixed with the engine's seed."""
        p = seq.params
        if p.greedy:
            return GREEDY_DRAW
        if p.seed is not None or p.min_p > 0 \
                or not (0 < p.top_k <= TOP_K_MAX or p.top_k <= 0 and p.top_p >= 1):
            return None
        return Draw(1.0 / p.temperature, (seq.arrival_order * 0x9E3779B1 + self.seed)
                    & 0x7FFFFFFF, max(p.top_k, 0), p.top_p)

    def _draw_params(self, draws: list[Draw], positions: list[int]) -> tuple:
        """``draw`` of :class:`~kernels.argmax.RowArgmax` for ``draws`` keyed at ``positions``
        (each row's input token's, as a decode graph keys it), in one upload."""
        host = torch.cat([pack_draws(draws), torch.tensor([positions], dtype=torch.int32)])
        dev = upload(host.view(-1), torch.int32, self.device).view(5, -1)
        return (dev[0].view(torch.float32), dev[1], dev[4], dev[2], dev[3].view(torch.float32))

    @staticmethod
    def _greedy_mask(params, device) -> torch.Tensor:
        return upload([p.greedy for p in params], torch.bool, device)

    @staticmethod
    def _probs(logits, params) -> torch.Tensor:
        """Each row's sampling distribution: temperature (1 for greedy rows), min-p, top-k,
        top-p."""
        temps = upload([1.0 if p.greedy else p.temperature for p in params],
                       torch.float32, logits.device).to(logits.dtype)
        logits = logits / temps[:, None]
        logits = _apply_min_p(logits, [p.min_p for p in params])
        logits = _apply_top_k_top_p(logits, [p.top_k for p in params],
                                    [p.top_p for p in params])
        return torch.softmax(logits, dim=-1)

    def probabilities(self, logits: torch.Tensor, params) -> torch.Tensor:
        """The distribution each row's token is drawn from (greedy rows: all on the argmax);
        for a logits processor-free row, as :meth:`__call__` draws it."""
        probs = self._probs(logits, params)
        if any(p.greedy for p in params):
            greedy = self._greedy_mask(params, logits.device)
            one_hot = torch.zeros_like(probs).scatter_(1, self.argmax(logits)[:, None], 1.0)
            probs = torch.where(greedy[:, None], one_hot, probs)
        return probs

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One id per row, drawn in proportion to ``probs`` (need not sum to one)."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        return self.argmax(probs / q)

    def _sample(self, logits, params, generators, positions) -> torch.Tensor:
        probs = self._probs(logits, params)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        _seeded_noise(q, [(i, gen, params[i].seed, positions[i])
                          for i, gen in enumerate(generators) if gen is not None])
        return self.argmax(probs / q)

    def seeded_draws(self, probs: torch.Tensor, rows) -> torch.Tensor:
        """Row ``i``'s draw from ``probs[i]`` with the noise a seeded request's token at
        ``position`` is drawn with (``rows``: ``(generator, seed, position)`` per row): the
        token :meth:`__call__` draws there from the same distribution."""
        q = torch.empty_like(probs)
        _seeded_noise(q, [(i, *row) for i, row in enumerate(rows)])
        return self.argmax(probs / q)


def _seeded_noise(q: torch.Tensor, rows) -> None:
    """Fill row ``i`` of ``q`` with Exp(1) noise from ``generator`` seeded by (seed, position),
    for each ``(i, generator, seed, position)``."""
    for i, gen, seed, position in rows:
        gen.manual_seed(position_seed(seed, position))
        q[i].exponential_(generator=gen)


def processed(logits: torch.Tensor, seqs, prev_tokens: torch.Tensor | None,
              eos_ids: frozenset[int], masks: tuple[list[int], torch.Tensor] | None
              ) -> torch.Tensor:
    """``logits`` as the draw sees them: the grammars' ``masks`` (rows, host bitmask) applied,
    then each row's bias, ``min_tokens`` ban and penalties (:func:`change_logits`); a copy
    where anything changes, ``logits`` itself otherwise. ``seqs``: one per row."""
    if masks is not None:
        logits = logits.clone()
        apply_bitmasks(logits, *masks)
    if any(s.params.changes_logits for s in seqs):
        logits = change_logits(logits if masks is not None else logits.clone(), seqs,
                               prev_tokens, eos_ids)
    return logits


def change_logits(logits: torch.Tensor, seqs: Seq[Sequence], prev_tokens: torch.Tensor | None,
                   eos_ids: frozenset[int]) -> torch.Tensor:
    """``logits`` (a copy) with each row's bias, ``min_tokens`` ban and penalties applied."""
    vocab = logits.shape[1]
    rows, cols, values = [], [], []
    for i, seq in enumerate(seqs):
        p = seq.params
        for token, bias in p.logit_bias:
            if token < vocab:
                rows.append(i), cols.append(token), values.append(bias)
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
            for token in sorted(t for t in banned if t < vocab):
                rows.append(i), cols.append(token), values.append(float("-inf"))
    if rows:
        index = upload(rows + cols, torch.int64, logits.device).view(2, -1)
        logits.index_put_((index[0], index[1]),
                          upload(values, torch.float32, logits.device).to(logits.dtype),
                          accumulate=True)
    penalized = [i for i, seq in enumerate(seqs)
                 if seq.params.presence_penalty or seq.params.frequency_penalty
                 or seq.params.repetition_penalty != 1.0]
    if penalized:
        _apply_penalties(logits, [seqs[i] for i in penalized], penalized, prev_tokens)
    return logits


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                     prev_tokens: torch.Tensor | None) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, in place.

    Each row's history goes up as one padded ``[R, L]`` id tensor: its output tokens (and, with
    a repetition penalty, its prompt before them); a token still pending on the device is
    marked ``PENDING`` there and read from ``prev_tokens``."""
    vocab, device = logits.shape[1], logits.device
    histories, starts, pending = [], [], []
    for seq in seqs:
        p = seq.params
        out_start = max(seq.num_prompt_tokens - p.num_resumed_tokens, 0)
        lo = 0 if p.repetition_penalty != 1.0 else out_start
        histories.append(seq.token_ids[lo:])
        starts.append(out_start - lo)
        if seq.num_pending > 1:
            raise RuntimeError("penalties: more than one token pending")
        pending.append(seq.pending_row if seq.num_pending else 0)
    width = max(1, max(len(h) for h in histories))
    pad = vocab  # an extra column, dropped after counting
    flat = [t for h in histories for t in (*h, *[pad] * (width - len(h)))]
    ids = upload(flat, torch.int64, device).view(len(seqs), width)
    if any(seq.num_pending for seq in seqs):
        if prev_tokens is None:
            raise RuntimeError("penalties: a pending token but no running step")
        fill = prev_tokens[upload(pending, torch.int64, device)]
        ids = torch.where(ids == PENDING, fill[:, None], ids)
    is_output = (torch.arange(width, device=device)[None, :]
                 >= upload(starts, torch.int64, device)[:, None])
    counts = torch.zeros(len(seqs), vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, torch.where(is_output, ids, pad), torch.ones_like(ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    index = upload(rows, torch.int64, device)
    sub = logits[index]
    params = [s.params for s in seqs]
    rep, freq, pres = upload([p.repetition_penalty for p in params]
                             + [p.frequency_penalty for p in params]
                             + [p.presence_penalty for p in params], torch.float32,
                             device).to(logits.dtype).view(3, len(seqs), 1)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, ids, True)
        sub = torch.where(seen[:, :vocab], torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).to(logits.dtype)
    logits[index] = sub


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    if not any(min_p):
        return logits
    m = upload(min_p, torch.float32, logits.device).to(logits.dtype)
    probs = logits.softmax(dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * m[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int],
                       top_p: list[float]) -> torch.Tensor:
    """Keep each row's ``top_k`` most likely tokens, ties with the k-th included (as vLLM
    does), then those whose more likely tokens hold less than ``top_p`` of the kept mass (a
    tie group stays or goes whole, as a probability threshold does; the most likely token
    always stays): :func:`kernels.argmax.cut_reference`, which a decode graph's draw follows.
    Tokens are ranked only as deep as the largest ``top_k`` unless a row cuts by ``top_p``
    alone, which needs the whole vocabulary ranked."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]  # 0: no top-k
    by_p = [p < 1.0 for p in top_p]
    if not any(ks) and not any(by_p):
        return logits
    deep = any(cut and not k for k, cut in zip(ks, by_p))
    ranked, order = logits.sort(dim=-1, descending=True) if deep \
        else logits.topk(max(ks), dim=-1)
    if any(ks):
        kth = ranked.gather(1, upload([max(k - 1, 0) for k in ks], torch.int64,
                                      logits.device)[:, None])
        if not all(ks):
            kth = torch.where(upload([k > 0 for k in ks], torch.bool, logits.device)[:, None],
                              kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if not any(by_p):
        return logits
    probs = logits.softmax(dim=-1).gather(1, order)  # (0 past the top-k)
    ahead = probs.cumsum(dim=-1) - probs  # the mass ranked before each token
    # The floor: the last token ranked with less than top_p ahead of it (its ties, ranked
    # after it, hold the same mass above them and stay too)
    cut = upload(top_p, torch.float32, logits.device)
    last = ((ahead < cut[:, None]) & (probs > 0)).sum(dim=-1, keepdim=True).clamp_(min=1) - 1
    floor = ranked.gather(1, last)
    if not all(by_p):
        floor = torch.where(cut[:, None] < 1.0, floor, float("-inf"))
    return logits.masked_fill(logits < floor, float("-inf"))
