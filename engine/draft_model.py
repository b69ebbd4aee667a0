"""Draft-model proposals (``speculative_config`` ``method: "draft_model"``; the verification is
:mod:`engine.spec_decode`'s).

A smaller model of the target's vocabulary (Qwen3-0.6B for 8B, 14B or 32B) proposes each
speculating sequence's next ``k`` tokens greedily, ``k`` steps of one token a sequence, the
first reading the sequence's last token; the target then verifies them in one step. A greedy
draft's proposal is certain (its ``q`` one-hot), so the rejection sampling of
:func:`engine.spec_decode.verify` keeps the target's distribution as it does for n-gram
proposals.

The draft's KV cache. The draft has its own paged cache with as many blocks as the target's and
of the same block size, and uses the target's block tables: block ``b`` of the target's cache
and block ``b`` of the draft's hold the same positions of the same sequence. The draft costs no
block bookkeeping of its own; the engine sizes the blocks so both caches fit the memory budget
(:class:`engine.model_runner.ModelRunner`'s ``extra_block_bytes``). The target's cache alone
travels (prefix cache, host tier, hand-over), so a sequence's draft KV is trusted only where the
draft wrote it for that sequence since its blocks were given (``Sequence.num_draft_computed``,
cut to the target's ``num_computed_tokens``, past which the draft's KV was for rejected
proposals). Whatever it lacks, the draft computes before it proposes (catch-up): the whole
prompt the first time (a decode replica prefills the small draft itself rather than receive its
KV over the transfer layer), the last token after each verified step (two tokens when every
proposal was kept), the tokens of steps that did not speculate.

The draft runs on rank 0 (unsplit with tensor parallelism), on the engine's stream, with its own
CUDA graphs: the ``k`` one-token steps replay its decode graphs, each reading the previous
step's tokens on the device. On one rank, without grammars or logits processors that read the
proposals, the host does not wait for them: the target's step is prepared and launched behind
the draft's, reading the proposals on the device (``Sequence.draft_rows``), and they come back
with the verification's result, in its one wait (measured on an H100: the host's preparation of
the target's step no longer leaves the GPU idle, docs/benchmarks.md). Otherwise the host waits
once, for all ``k`` proposals, before the target's step is prepared.

The step ahead. The host's work between a verification's result and the draft's next step
(the tokens, stop checks and outputs, the next schedule, the draft's inputs) left the GPU idle
0.4-0.6 ms a round on an H100 (8B FP8 target, a round ~7 ms). So, where the proposals stay on
the device, the round's first draft step is queued behind the verification before the host has
its result (:meth:`DraftProposer.launch_ahead`): one row a sequence, the target's token after
the last kept proposal (or, when every proposal was kept, the last proposal), its position,
slot and pages written on the device by :mod:`kernels.ahead_inputs` into the draft graph's
staged inputs. The next :meth:`DraftProposer.propose` starts from that step's tokens for each
sequence it still fits; the others (a sequence that joined, was preempted, skipped a round, or
kept every proposal: one token still to take) take their first step then, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.block_pool import NULL_BLOCK
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledBatch
from engine.sequence import PENDING, Sequence
from engine.spec_decode import kept_run
from engine.structured import apply_bitmasks
from engine.uploads import upload
from kernels.ahead_inputs import ahead_inputs
from kernels.argmax import RowArgmax


@dataclass(eq=False)
class _View:
    """What :meth:`ModelRunner.prepare` reads of a sequence, for one of the draft's steps."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    num_pending: int = 0
    pending_row: int = -1
    draft_token_ids: list[int] = field(default_factory=list)
    num_present_tokens: int = 0  # the draft writes its KV at every position it computes
    prompt_logprobs: None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending


SHORT = 2  # tokens a sequence may lack in the draft's cache for its first proposing step
# The draft's first step of a round queued behind the verification (the step ahead, below);
# ``BATON_DRAFT_AHEAD=0`` turns it off (the step then runs once the host has the result).
AHEAD = os.environ.get("BATON_DRAFT_AHEAD", "1") != "0"


@dataclass(eq=False)
class _Ahead:
    """A draft step queued behind a verification (:meth:`DraftProposer.launch_ahead`): for
    each sequence, its length and the draft's count before it, its proposals, and its row in
    ``tokens`` (the draft's next proposal, on the device)."""

    seqs: list[Sequence]
    lengths: list[int]
    computed: list[int]
    proposals: list[int]
    tokens: torch.Tensor

    def __post_init__(self):
        self.index = {s: i for i, s in enumerate(self.seqs)}

    def row(self, seq: Sequence) -> int | None:
        """``seq``'s row, if the step ahead is its next step: nothing has changed since but the
        verification's tokens (1 to ``k + 1`` of them) and no token waits to be computed."""
        i = self.index.get(seq)
        if i is None:
            return None
        new = seq.num_tokens - self.lengths[i]
        if 1 <= new <= self.proposals[i] + 1 and seq.num_computed_tokens == seq.num_tokens - 1 \
                and seq.num_draft_computed == self.computed[i] and not seq.num_pending:
            return i
        return None

    def complete(self, seq: Sequence, i: int) -> bool:
        """Whether row ``i`` took ``seq``'s last token (some proposal was rejected), its
        argmax the next proposal, rather than the last proposal (every one kept)."""
        return seq.num_tokens - self.lengths[i] <= self.proposals[i]


class DraftProposer:
    """Fills the proposals of a step's speculating sequences with the draft's greedy tokens."""

    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int):
        self.runner = runner
        self.max_tokens = max_num_batched_tokens  # a catch-up pass's budget
        self.steps = 0  # the draft's forward passes (catch-up, proposing, ahead), ever
        self.steps_ahead = 0  # of them, steps queued behind a verification
        self.seqs_ahead = 0  # sequences whose first step of a round ran ahead, ever
        self.argmax = RowArgmax()
        self.ahead: _Ahead | None = None
        self._compile_ahead()

    def _compile_ahead(self) -> None:
        """Compile the step ahead's kernel at start-up (a first launch mid-run would stall
        that step): one launch over one dummy row, into the staged inputs, which every step
        writes again."""
        graphs = self.runner.graphs
        size = graphs.written_size(1, 1) if graphs is not None else None
        if not AHEAD or size is None:
            return
        zeros = torch.zeros(2, dtype=torch.int64, device=self.runner.device)
        ahead_inputs(graphs.staged.buffer, size, zeros.bool(), zeros, zeros,
                     zeros.new_tensor([[0, 1, 0]]), zeros.new_zeros(1, 1),
                     self.runner.block_size, NULL_BLOCK, 1)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], grammars=None,
                on_device: bool = False) -> torch.Tensor | None:
        """``seqs``' ``draft_token_ids`` hold as many placeholders as the scheduler made room
        for (at most ``k``); replace them with the draft's tokens. A structured output's
        proposals follow its grammar (``grammars``: :class:`engine.structured.Grammars`): each
        of the draft's steps is masked by the matcher as the proposals before it left it (the
        host then waits for every step's tokens), and the matcher is rolled back after.

        ``on_device`` (no grammar among ``seqs``): nothing waits; the proposals stay on the
        device, in the returned tensor, each sequence's ``draft_rows`` saying where its are
        (its ``draft_token_ids`` stay placeholders): the target's step reads them there and the
        verification brings them to the host with its own result (one wait for both)."""
        views = [_View(list(s.token_ids), s.block_ids,
                       min(s.num_draft_computed, s.num_computed_tokens), s.num_prompt_tokens)
                 for s in seqs]
        taken = {i: 0 for i, s in enumerate(seqs) if s.matcher is not None}  # tokens matched
        ahead, self.ahead = self.ahead, None
        done = {}  # view -> its row in the step ahead, which was its first step
        if ahead is not None and not taken:
            for i, s in enumerate(seqs):
                if (row := ahead.row(s)) is not None:
                    self.seqs_ahead += 1
                    # the draft's cache holds the sequence, or all but its last token
                    views[i].num_computed_tokens = views[i].num_tokens - 1
                    if ahead.complete(s, row):
                        views[i].num_computed_tokens += 1
                        done[i] = row
        self._catch_up(views)
        lengths = [len(s.draft_token_ids) for s in seqs]
        rows: list[list[int]] = []  # per step, the views it ran (their rows in its tokens)
        tokens: list[torch.Tensor] = []
        if done:
            self._first_from_ahead(ahead, done, views, lengths, rows, tokens)
        for j in range(len(tokens), max(lengths)):
            active = [i for i in range(len(seqs)) if lengths[i] > j]
            for i in active:
                if j:  # its input: the token the step before drew, on the device
                    views[i].token_ids.append(PENDING)
                    views[i].num_pending = 1
                    views[i].pending_row = rows[-1].index(i)
            counts = [views[i].num_tokens - views[i].num_computed_tokens for i in active]
            logits = self._run([views[i] for i in active], counts, tokens[-1] if j else None)
            if taken:
                logits = self._masked(logits, active, seqs, grammars)
            tokens.append(self.argmax(logits))
            if taken:
                self._match(tokens[-1], active, seqs, taken)
            rows.append(active)
            for i, n in zip(active, counts):
                views[i].num_computed_tokens += n
        for i, n in taken.items():
            if n:
                seqs[i].matcher.rollback(n)
        at = 0
        where: list[list[int]] = [[] for _ in seqs]  # each proposal's row in the tokens
        for step_rows in rows:
            for i in step_rows:
                where[i].append(at)
                at += 1
        for seq, n in zip(seqs, lengths):
            # the draft's KV now covers the last token and every proposal but the last
            seq.num_draft_computed = seq.num_tokens + n - 1
        drafted = torch.cat(tokens)
        if on_device and not taken:
            for seq, rows_of in zip(seqs, where):
                seq.draft_rows = rows_of
            return drafted
        drawn = drafted.tolist()  # the one wait on the device (without grammars)
        for seq, rows_of in zip(seqs, where):
            seq.draft_token_ids = [drawn[r] for r in rows_of]
        return None

    def _first_from_ahead(self, ahead: _Ahead, done: dict[int, int], views: list[_View],
                          lengths: list[int], rows: list[list[int]],
                          tokens: list[torch.Tensor]) -> None:
        """The first proposing step: the step ahead's tokens for the views in ``done``, and
        a step now for the others (first those, then these, in its tokens)."""
        first = list(done)
        picked = [done[i] for i in first]
        own = ahead.tokens if picked == list(range(len(ahead.seqs))) else \
            ahead.tokens[upload(picked, torch.int64, ahead.tokens.device)]
        rest = [i for i in range(len(views)) if i not in done and lengths[i]]
        if rest:
            counts = [views[i].num_tokens - views[i].num_computed_tokens for i in rest]
            own = torch.cat([own, self.argmax(self._run([views[i] for i in rest], counts,
                                                          None))])
            for i, n in zip(rest, counts):
                views[i].num_computed_tokens += n
        rows.append(first + rest)
        tokens.append(own)

    def launch_ahead(self, chosen: list[tuple[int, Sequence, int]], kept: torch.Tensor,
                     drawn: torch.Tensor, proposed: torch.Tensor) -> None:
        """Queue the next round's first step behind the verification, before the host has its
        result: ``chosen``, (first verification row, sequence, proposals ``k``) of the
        sequences whose blocks hold position ``P + k + 1`` (``P``: its last token's);
        ``kept``, ``drawn``, ``proposed``: the rows' device results
        (:func:`engine.spec_decode.verify`).

        One row a sequence, whatever the count ``n`` of kept proposals turns out to be: the
        target's token at ``P + n + 1`` where ``n < k`` (the draft then holds the whole
        sequence, and the row's argmax is its next proposal), else the last proposal at
        ``P + k`` (the target's token after it is then left to the next step, one row instead
        of two). On CUDA a kernel writes the rows and page table from the device results into
        the staged inputs of the draft's decode graphs and the graph is replayed (nothing here
        waits; where no graph on the few-row attention kernel takes the rows, there is no step
        ahead). On the CPU the same step runs through the host. The next :meth:`propose` takes
        it as its first step's where it still fits (:meth:`_Ahead.row`)."""
        if not AHEAD or not chosen:
            return
        runner = self.runner
        seqs = [s for _, s, _ in chosen]
        ks = [k for _, _, k in chosen]
        bs = runner.block_size
        if runner.device.type == "cuda":
            graphs = runner.graphs
            longest = max(s.num_tokens + k + 1 for s, k in zip(seqs, ks))
            size = graphs.written_size(len(seqs), longest) if graphs is not None else None
            if size is None:
                return
            width = -(-longest // bs)
            fields, table = [], []
            for row0, s, k in chosen:
                fields += (row0, k, s.num_tokens - 1)
                pages = s.block_ids[:width]
                table += pages + [NULL_BLOCK] * (width - len(pages))
            host = upload(fields + table, torch.int64, runner.device)
            ahead_inputs(graphs.staged.buffer, size, kept, drawn, proposed,
                         host[:len(fields)].view(-1, 3), host[len(fields):].view(-1, width),
                         bs, NULL_BLOCK, max(ks))
            tokens = self.argmax(graphs.replay_written(size, len(seqs)))
            self.steps += 1
        else:
            kept_l, drawn_l, proposed_l = kept.tolist(), drawn.tolist(), proposed.tolist()
            views = []
            for row0, s, k in chosen:
                n = kept_run(kept_l, row0, k)
                more = proposed_l[row0:row0 + n] + ([drawn_l[row0 + n]] if n < k else [])
                views.append(_View(s.token_ids + more, s.block_ids,
                                   s.num_tokens + len(more) - 1, s.num_prompt_tokens))
            tokens = self.argmax(self._run(views, [1] * len(views), None))
        self.steps_ahead += 1
        self.ahead = _Ahead(seqs, [s.num_tokens for s in seqs],
                            [s.num_draft_computed for s in seqs], ks, tokens)

    @staticmethod
    def _masked(logits: torch.Tensor, active: list[int], seqs: list[Sequence],
                grammars) -> torch.Tensor:
        """The step's logits with each grammar's disallowed tokens out, where its matcher is
        still open."""
        matchers = {row: seqs[i].matcher for row, i in enumerate(active)
                    if seqs[i].matcher is not None and not seqs[i].matcher.is_terminated()}
        if not matchers:
            return logits
        logits = logits.clone()  # (a graph's output buffer)
        apply_bitmasks(logits, list(matchers), grammars.bitmasks(len(active), matchers))
        return logits

    @staticmethod
    def _match(drawn: torch.Tensor, active: list[int], seqs: list[Sequence],
               taken: dict[int, int]) -> None:
        """Each open matcher takes its sequence's drawn token (counted, for the rollback)."""
        host = drawn.tolist()
        for row, i in enumerate(active):
            m = seqs[i].matcher
            if m is not None and not m.is_terminated() and m.accept_token(host[row]):
                taken[i] += 1

    def _catch_up(self, views: list[_View]) -> None:
        """The draft's KV for each view's tokens but its last, in passes of at most the step
        budget (a long prompt split over passes), where more than ``SHORT`` are missing; the
        first proposing step takes the rest (two tokens after a step that kept every
        proposal: one row each of a decode graph, ``ModelRunner._as_rows``)."""
        todo = [v for v in views if v.num_tokens - v.num_computed_tokens > SHORT]
        while todo:
            batch, counts, budget = [], [], self.max_tokens
            for v in todo:
                n = min(v.num_tokens - 1 - v.num_computed_tokens, budget)
                if n <= 0:
                    break
                batch.append(v)
                counts.append(n)
                budget -= n
            self._run(batch, counts, None)
            for v, n in zip(batch, counts):
                v.num_computed_tokens += n
            todo = [v for v in todo if v.num_tokens - v.num_computed_tokens > 1]

    def _run(self, views: list[_View], counts: list[int],
             prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        self.steps += 1
        runner = self.runner
        return runner.run(runner.prepare(ScheduledBatch(views, counts)), prev_tokens)
