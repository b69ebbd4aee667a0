"""Speculative decoding (vLLM's ``speculative_config``; :class:`engine.config.SpeculativeConfig`).

A decoding sequence's next tokens are proposed (``method: "ngram"``: prompt lookup, below;
``"draft_model"``: a smaller model, :mod:`engine.draft_model`); the scheduler gives the sequence
one step of ``1 + k`` tokens, its last token and the ``k`` proposals, and the target computes
logits at all of them at once. :func:`verify` then keeps the proposals the target agrees with,
and one token more: the target's own at the first disagreement, or a bonus token after the last
proposal. So a step makes 1 to ``k + 1`` tokens for the price of one weight read.

Lossless. Greedy: a proposal is kept when it is the target's argmax, so the tokens are exactly
those of no speculation. Sampling (rejection sampling, as in Leviathan et al. and vLLM): a
proposal ``d`` drawn with probability ``q(d)`` is kept with probability ``min(1, p(d) / q(d))``
under the target's distribution ``p`` after temperature, min-p, top-k and top-p; at the first
rejection the token is drawn from the residual ``max(p - q, 0)``, normalised. An n-gram proposal
is certain (``q`` is one-hot), so it is kept with probability ``p(d)`` and the residual is ``p``
without ``d``; so is a greedy draft model's. Each emitted token so follows the target's
distribution.

Every sequence speculates: a grammar masks each row and the logits processors apply to it with
the proposals before it in the history; logprobs are taken from the verification's rows
(:func:`verified_logprobs`). A request with a per-request seed draws each row with the noise its
token at that position is drawn with one token a step (``engine.sampler``: seeded by (seed,
position)), and a proposal is kept when that draw is the proposal: the same tokens as without
speculation, so a seeded request stays reproducible whether speculation is on or off, and a
certain proposal is kept with probability ``p(d)``, as rejection sampling keeps it. The stop
conditions are checked token by token, so a sequence stops at the first stop token or length it
reaches within a step.

When to speculate (:class:`SpecController`). A proposal needs the tokens of the step before, so
a step that proposes cannot run ahead of the device (``async_scheduling``), and proposing costs
time each step (host time for n-gram lookups, the draft's steps for a draft model). Speculation
goes on while the proposals pay: while the recent proposals' acceptance is at least
``MIN_ACCEPTANCE``, no ``EMPTY_STEPS`` steps in a row found nothing to propose, and, once both
are measured, a speculating step makes more tokens a sequence a second than a step without
speculation (a large batch, where the verification's extra tokens stop being free, or a draft
too slow for its acceptance: the wall time of the decode steps either way, moving averages;
while speculation is on, ``MEASURE_STEPS`` steps in ``MEASURE_EVERY`` run without it to follow
the batch, the first such window after ``MEASURE_FIRST`` speculating steps where no step without
speculation was timed yet; the first speculating step after it goes on, which catches a draft
up, is not timed, and the rule waits for ``SPEED_STEPS``; each time in a row it turns
speculation off, the next look comes twice as late). Otherwise the engine runs ahead as without
speculation and looks again after ``PROBE_EVERY`` steps, then twice as long after each look that
finds it does not pay (up to ``PROBE_MAX``), and never sooner than makes the looks' measured
cost (the wall time a look adds to a step without speculation) ``PROBE_COST`` of the steps'
time. A look while speculation is off (a probe, the engine's first step included) proposes for
``PROBE_SEQS`` sequences at most, the others decoding as they would, so that a load speculation
does not help loses little more than one overlapped step in that many: a draft model catches up
and proposes for those few, and their few extra tokens ride in the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from engine.config import SpeculativeConfig
from engine.sampler import processed
from engine.sequence import Sequence
from engine.uploads import Download, upload


PROBE_EVERY = 16  # steps between two that look for proposals once speculation goes off,
PROBE_MAX = 256  # doubled after each look that does not turn it on again, up to this
PROBE_SEQS = 4  # sequences a look while off proposes for
PROBE_COST = 0.01  # of the steps' time, at most, that looks while off cost
MIN_ACCEPTANCE = 0.5  # of the recent proposed tokens, for speculation to go on
EMPTY_STEPS = 4  # steps in a row that find no proposal at all before speculation goes off
WEIGHT = 0.3  # of the newest step in the moving averages
MEASURE_EVERY = 128  # speculating steps between two windows of steps without speculation,
MEASURE_FIRST = 8  # (this many before the first while no step without it has been timed)
MEASURE_STEPS = 3  # of this many steps (the first follows a speculating step: not timed)
SPEED_STEPS = 4  # speculating steps timed before the speed rule may turn it off


class SpecController:
    """Whether the next step looks for proposals (see the module's docstring)."""

    def __init__(self, min_acceptance: float = MIN_ACCEPTANCE, empty_steps: int = EMPTY_STEPS,
                 probe_every: int = PROBE_EVERY, min_gain: float | None = 1.0,
                 start_on: bool = False):
        """``min_gain``: the speculating steps' tokens a sequence a second over the plain
        steps' below which speculation goes off (None: never for its speed); ``start_on``:
        speculate from the first step, rather than look at a few sequences first."""
        self.min_acceptance, self.empty_steps = min_acceptance, empty_steps
        self.min_gain = min_gain
        self.probe_first = self.probe_every = probe_every
        self.on = start_on
        self.acceptance: float | None = None  # moving average over speculating steps
        self.plain_s: float | None = None  # a decode step without speculation, run ahead
        self.spec_rate: float | None = None  # tokens a sequence a second, speculating steps
        self._since = probe_every  # steps since the last that could propose (a look is due)
        self._empty = 0  # looking steps in a row that found nothing to propose
        self._looked = 0  # speculating steps since the last window without speculation
        self._plain_left = 0  # steps left of the current window without speculation
        self._probe_s: float | None = None  # the wall time of the last look while off
        self._spec_steps = 0  # speculating steps timed since speculation went on
        self._slow = 0  # times in a row it went off for its speed

    def wants(self) -> bool:
        """Whether the next step should look (it can once no step is running)."""
        return (self.on and not self._plain_left) or \
            (not self.on and self._since >= self.probe_every)

    def stepped(self, looked: bool) -> None:
        """A step ran; ``looked``: a sequence in it could propose (the first step, a prompt's,
        cannot: a look stays due)."""
        self._since = 0 if looked else self._since + 1
        if not self.on or self.min_gain is None:
            return
        if looked:
            self._looked += 1
            if self._looked >= (MEASURE_EVERY if self.plain_s is not None else MEASURE_FIRST):
                if self.plain_s is not None:
                    self._slow = 0  # it has paid for MEASURE_EVERY steps
                self._looked, self._plain_left = 0, MEASURE_STEPS
        elif self._plain_left:
            self._plain_left -= 1

    def update(self, drafted: int, accepted: int) -> None:
        """A step that looked for proposals: how many tokens were proposed and accepted."""
        was_on = self.on
        if not drafted:
            self._empty += 1
            self.on = self.on and self._empty < self.empty_steps
        else:
            self._empty = 0
            rate = accepted / drafted
            self.acceptance = _ema(self.acceptance, rate)
            self.on = self.acceptance >= self.min_acceptance
        self._switched(was_on)

    def timed(self, looked: bool, seconds: float, tokens_per_seq: float = 1.0,
              probe: bool = False) -> None:
        """A decode step's wall time (no prompt tokens in it): one that speculated while
        speculation was on (``tokens_per_seq`` made), a look while it was off (``probe``), or
        one run ahead without speculation."""
        if probe:
            if not self.on:  # it stays off: the next look no sooner than the cost allows
                self._probe_s = seconds
                self._space_probes()
            return
        if not looked:
            self.plain_s = _ema(self.plain_s, seconds)
            if not self.on:
                self._space_probes()
            return
        self._spec_steps += 1
        if self._spec_steps == 1:  # the first after turning on catches the draft up: not
            return  # what a step costs
        self.spec_rate = _ema(self.spec_rate, tokens_per_seq / seconds)
        if self.on and self.min_gain is not None and self.plain_s is not None \
                and self._spec_steps > SPEED_STEPS \
                and self.spec_rate * self.plain_s < self.min_gain:
            self.on = False  # it makes fewer tokens a second than not speculating: look
            self._switched(True)  # again later, twice as late each time this repeats
            self._slow += 1
            self.probe_every = min(self.probe_first << self._slow, PROBE_MAX)

    def _space_probes(self) -> None:
        """Looks while off no closer than makes their cost (the last look's wall time over a
        step's without speculation, once both are known) PROBE_COST of the steps' time."""
        if self._probe_s is not None and self.plain_s:
            cost = self._probe_s / self.plain_s - 1
            self.probe_every = max(self.probe_every, min(int(cost / PROBE_COST), 4 * PROBE_MAX))

    def _switched(self, was_on: bool) -> None:
        if self.on and not was_on:  # a look that paid: time speculation afresh
            self.spec_rate, self._looked, self._plain_left = None, 0, 0
            self._probe_s, self._spec_steps = None, 0
        if self.on:
            self.probe_every = self.probe_first
        elif not was_on:  # a look while off that did not pay: look half as often
            self.probe_every = min(2 * self.probe_every, PROBE_MAX)


def _ema(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - WEIGHT) * average + WEIGHT * sample


class NgramProposer:
    """Prompt lookup: the longest suffix of ``prompt_lookup_max`` down to ``prompt_lookup_min``
    tokens that occurred earlier in the sequence (prompt and output); the tokens that followed
    its latest earlier occurrence with ``k`` tokens after it (else its earliest) are proposed."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start early enough for a token to follow them, the suffix excluded
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:  # the latest occurrence that k tokens follow, else the earliest
                full = hits[hits + n + k <= len(tokens)]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []


class _RowView:
    """A verification row's sequence for the logits processors: ``seq`` followed by the
    proposals before the row (what its history is if they are kept)."""

    def __init__(self, seq: Sequence, before: list[int]):
        self.params = seq.params
        self.token_ids = seq.token_ids + before
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_output_tokens = seq.num_output_tokens + len(before)
        self.num_pending, self.pending_row = 0, -1


@dataclass
class SpecStats:
    """vLLM's acceptance figures: steps that verified proposals, proposals, accepted ones, and
    accepted ones by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafts: list[int], accepted: int) -> None:
        if not drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < len(drafts):
            self.accepted_per_position += [0] * (len(drafts) - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def verify(sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
           stats: SpecStats | None = None, eos_ids: frozenset[int] = frozenset(),
           grammars=None, drafted: torch.Tensor | None = None, before_wait=None
           ) -> tuple[list[list[int]], torch.Tensor]:
    """``logits``: float32 ``[sum(1 + len(d)), V]``, each sequence's rows in order (its last
    token's, then one after each proposal). Returns each sequence's new tokens (the proposals
    kept, then one more) and, on the device, one id per row (what the other ranks of a
    tensor-parallel engine are sent). A structured output's grammar masks each row as it stands
    after the proposals before that row (``grammars``: :class:`engine.structured.Grammars`),
    and logits processors (bias, ``min_tokens``, penalties) apply to each row as to a decode
    step whose sequence ends with those proposals (``eos_ids``: banned until ``min_tokens``,
    as the sampler bans them).

    ``drafted``: the draft's proposals left on the device (each sequence's ``draft_rows`` say
    where its are; ``drafts`` hold placeholders, filled in place with the proposals once they
    have come back with the verification's result, in the one wait). Only without grammars and
    logits processors that read the rows' tokens (they need the proposals on the host first).
    ``before_wait(kept, drawn, proposed)`` (with ``drafted``): called with the rows' device
    results once they are queued, before the host waits for them (the draft's step ahead,
    :meth:`engine.draft_model.DraftProposer.launch_ahead`); the wait is for them alone."""
    counts = [1 + len(d) for d in drafts]
    params = [s.params for s, c in zip(seqs, counts) for _ in range(c)]
    device = logits.device
    starts = list(accumulate(counts[:-1], initial=0))
    entries = [(row, s.matcher, d) for row, s, d in zip(starts, seqs, drafts)
               if s.matcher is not None]
    masks = grammars.verify_bitmasks(len(params), entries) if entries else None
    # each row's sequence, made only where a logits processor reads it (a copy of its tokens)
    views = [_RowView(s, d[:i]) for s, d in zip(seqs, drafts) for i in range(len(d) + 1)] \
        if any(p.changes_logits for p in params) else []
    if drafted is not None and (entries or views):
        raise ValueError("proposals on the device cannot be verified under a grammar or a "
                         "logits processor that reads them")
    logits = processed(logits, views, None, eos_ids, masks)
    if drafted is None:  # each row's proposal to check (-1: the last row)
        proposed = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64,
                                device=device)
    else:
        where = upload([r for s, d in zip(seqs, drafts)
                        for r in (*(s.draft_rows if d else ()), -1)], torch.int64, device)
        proposed = torch.where(where >= 0, drafted[where.clamp(min=0)], -1)
    if all(p.greedy for p in params):
        row_ids = sampler.argmax(logits)
        kept = row_ids == proposed
        drawn = row_ids
    else:
        probs = sampler.probabilities(logits, params)
        draft_rows = proposed >= 0
        at = proposed.clamp(min=0)[:, None]
        p_draft = probs.gather(1, at).squeeze(1)
        uniform = torch.rand(p_draft.shape, generator=sampler.generator, device=device)
        kept = draft_rows & (uniform < p_draft)
        residual = torch.where(draft_rows[:, None], probs.scatter(1, at, 0.0), probs)
        drawn = sampler.draw(residual)
        seeded = [(row + i, (s.generator, s.params.seed, s.num_tokens + i))
                  for row, s, d in zip(starts, seqs, drafts) if s.generator is not None
                  for i in range(len(d) + 1)]
        if seeded:  # each row drawn with the noise of its token's position: kept if it agrees
            at_rows = torch.tensor([r for r, _ in seeded], device=device)
            own = sampler.seeded_draws(probs[at_rows], [draw for _, draw in seeded])
            drawn[at_rows] = own
            kept[at_rows] = draft_rows[at_rows] & (own == proposed[at_rows])
        row_ids = drawn
    if drafted is None:
        kept, drawn = kept.tolist(), drawn.tolist()
    else:  # the proposals come back with the result
        rows = len(params)
        back = Download(torch.cat([kept.long(), drawn, proposed]))
        if before_wait is not None:
            before_wait(kept, drawn, proposed)
        host = back.tolist()
        kept, drawn, values = host[:rows], host[rows:2 * rows], host[2 * rows:]
        row = 0
        for d, c in zip(drafts, counts):
            d[:] = values[row:row + c - 1]
            row += c
    out, row = [], 0
    for d, c in zip(drafts, counts):
        n = kept_run(kept, row, len(d))
        out.append(d[:n] + [drawn[row + n]])
        if stats is not None:
            stats.add(d, n)
        row += c
    return out, row_ids


def kept_run(kept: list, row: int, k: int) -> int:
    """How many of a sequence's ``k`` proposals are kept: the run of kept rows from ``row``
    (its first verification row) to the first rejection."""
    return next((i for i in range(k) if not kept[row + i]), k)


def verified_logprobs(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                      tokens: list[list[int]]) -> list[tuple[list[float], list | None] | None]:
    """The logprobs of each sequence's new tokens from a verified step (``logits`` and
    ``drafts`` as :func:`verify` took them, ``tokens`` what it returned): the log-softmax of the
    raw logits at the row that drew each token, as the sampler gives a decode step's, and the
    top ``logprobs`` of those rows; None for a sequence that did not ask."""
    asked = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    if not asked:
        return [None] * len(seqs)
    rows, ids, row = [], [], 0
    for d, out in zip(drafts, tokens):
        rows += range(row, row + len(out))
        ids += out
        row += 1 + len(d)
    device = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=device)], dim=-1)
    chosen = lp.gather(1, torch.tensor(ids, device=device)[:, None]).squeeze(1).tolist()
    top = lp.topk(max(asked), dim=-1) if max(asked) else None
    top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    result, at = [], 0
    for seq, out in zip(seqs, tokens):
        k, n = seq.params.logprobs, len(out)
        result.append(None if k is None else (
            chosen[at:at + n],
            [list(zip(top_i[r][:k], top_v[r][:k])) for r in range(at, at + n)] if k else None))
        at += n
    return result
