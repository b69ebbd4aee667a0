"""Continuous batching with chunked prefill under a token budget and preemption by recompute.

Queues: ``waiting`` → ``running``, both ordered by the request's ``priority`` (lower first, as
vLLM's priority scheduling; 0 by default), then by arrival: a new sequence goes behind those of
its priority, a preempted one back in front of them. ``running`` is in admission order within a
priority, which is also the order of preemption, from the end: the worst priority's most
recently admitted sequence is preempted first. A waiting sequence that finds no slot or no blocks
takes them from a running sequence of a worse priority (preempted, as vLLM's priority policy
does), so a request with a better priority does not wait for a queue of long ones to end.

Each step spends ``max_num_batched_tokens``: running sequences first (one token each when
decoding, the next chunk when still prefilling), then waiting sequences are admitted while
budget, ``max_num_seqs`` and free blocks allow. Admission matches the prefix cache; a full hit
still recomputes the last prompt token (its KV is not stored again). A waiting sequence whose
next prompt block a running sequence is computing right now is held back until that block is in
the cache (so n sequences of one prompt, or a burst of requests with a shared prefix, compute
it once). When a running sequence
needs a block and none is free, the last-admitted sequence is preempted: its blocks are freed
(and stay prefix-cache hits) and it is recomputed later. A sequence whose pending token is its
last is passed over (it ends as that token arrives, with its blocks: a prefill replica pushes
them), and a preempted one that has grown past what the cache can ever hold ends with
``length`` when it reaches the head of the queue.

Pending tokens (the engine runs one step ahead, :mod:`engine.sequence`): a running sequence whose
pending token is its last (``max_tokens``, the model's context) or would not fit the cache waits
for that token to arrive instead of being scheduled; a preempted sequence is not admitted again
before its pending token arrives; only known tokens are hashed for the prefix cache.

A bounded wait (``starvation_timeout_s``, :class:`engine.config.EngineConfig`; as SGLang bounds
a request's wait by preempting): when every slot (or block) is held by sequences of the same
priority, a waiting sequence would otherwise wait for one of them to end (a 16-token request
beside 64 of 2,046 tokens: 10-20 s on CPU). So a sequence never scheduled yet that has waited
``starvation_timeout_s`` since it arrived takes the slot of a running sequence of its own
priority (never a better one): of those that have run at least ``starvation_timeout_s`` since
they were last admitted (so a sequence preempted this way is not preempted again before it has
run that long once re-admitted: no ping-pong), the one with the most output tokens, skipping any
still prefilling (or recomputing) and any whose pending token is its last. The victim is
preempted by recompute (tokens kept, so greedy output is unchanged) and waits right behind the
starving sequence, which is admitted in the same step. Such a starving sequence goes ahead of
sequences of its priority that have been scheduled before (preempted ones, which have had their
turn), so a preempted one at the head of the queue cannot hold it back.
``num_starvation_preemptions`` counts these (they count in ``num_preemptions`` too). ``None``
turns it off.

Prompts whose blocks the host tier holds (``kv_offloading_size``, :mod:`engine.kv_offload`):
admission gives them device blocks whose copies in are queued, and they wait in ``loading``,
holding their slot, until the copies have landed (``KVCacheManager.copies_done``); the next
schedule after that lets them into the running batch, so other sequences' steps run while their
KV crosses the host link.

Blocks come from :class:`engine.kv_cache_manager.KVCacheManager` (match, allocate, grow, free,
commit): this module decides who runs, that one whether their tokens fit. Every unfinished
sequence is in ``requests`` by id.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler itself

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, starvation_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.kv = kv
        self.starvation_timeout_s = starvation_timeout_s  # None: no bounded wait
        self.clock = clock  # time.monotonic (Sequence.arrival_time's clock); tests pass a fake
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.transferring: dict[str, Sequence] = {}  # decode role: awaiting pushed KV
        self.loading: dict[str, Sequence] = {}  # awaiting the host tier's copies in
        self.held: dict[str, list[int]] = {}  # prefill role: finished, blocks kept for a push
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self.num_preemptions = 0  # every preemption, the ones below included
        self.num_starvation_preemptions = 0  # for a sequence that waited starvation_timeout_s
        self.finished_by_reason: dict[str, int] = {}  # sequences ended, ever, by reason
        # Seconds from arrival to first scheduling, of sequences not yet read by the metrics.
        self.queue_times: deque[float] = deque(maxlen=4096)
        # Speculative decoding (engine.spec_decode): proposals for a decoding sequence, at
        # most the given number of them. None: off.
        self.propose: Callable[[Sequence, int], list[int]] | None = None
        self.num_proposals_asked = 0  # sequences propose was called for, ever

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        _insert(self.waiting, seq, front=False)
        self.requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens still to be prefilled: of waiting and loading sequences, and of running
        ones whose prompt is not yet all computed (chunked prefill)."""
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                   for s in (*self.waiting, *self.loading.values(), *self.running))

    @property
    def num_slots_taken(self) -> int:
        return len(self.running) + len(self.transferring) + len(self.loading)

    def find(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    @property
    def num_releases(self) -> int:
        return self.kv.num_releases

    def finish(self, seq: Sequence, reason: FinishReason, hold_as: str | None = None) -> None:
        """End a sequence wherever it is and give its blocks back (or keep them in ``held``
        until :meth:`release_held`: a prefill-role sequence that finished normally, under its
        id; any, under ``hold_as``)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.transferring.pop(seq.request_id, None)
        self.loading.pop(seq.request_id, None)
        self.requests.pop(seq.request_id, None)
        seq.drop_pending()
        if hold_as is None and seq.hold_blocks and reason is not FinishReason.ABORT:
            hold_as = seq.request_id
        if hold_as is not None and seq.block_ids:
            self.held[hold_as] = seq.block_ids
            seq.block_ids = []
        else:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.finished_by_reason[reason.value] = self.finished_by_reason.get(reason.value, 0) + 1

    def release_held(self, request_id: str) -> None:
        blocks = self.held.pop(request_id, None)
        if blocks:
            self.kv.free_blocks(blocks)

    # -- decode role: KV arrives by transfer ----------------------------------------------------
    def reserve(self, seq: Sequence) -> bool:
        """Match the prefix cache and reserve blocks for the rest of ``seq``'s prompt, outside
        the running batch. False (nothing taken) when blocks or sequence slots are short."""
        if self.num_slots_taken >= self.max_num_seqs:
            return False
        if not self.kv.allocate(seq, self.kv.match(seq), seq.num_tokens):
            return False
        seq.num_computed_tokens = seq.num_present_tokens
        seq.status = SequenceStatus.TRANSFERRING
        self.transferring[seq.request_id] = seq
        self.requests[seq.request_id] = seq
        self._started(seq)
        return True

    def admit_transferred(self, seq: Sequence) -> None:
        """The KV of every prompt token is in ``seq``'s blocks: join the running batch (a first
        token it took ahead of its KV is computed in its next step)."""
        del self.transferring[seq.request_id]
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.wait_for(seq.kv_load)  # blocks the host tier fills, in the next step it joins
        self.kv.commit(seq)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_time = self.clock()
        _insert(self.running, seq, front=False)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self._admit_loaded()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.num_pending and (self._length_done(seq) or seq.matcher is not None
                                    or not self.kv.fits_at_all(seq.num_computed_tokens + n)):
                # Its pending token is its last, or its grammar must see it before the next
                # draw can be masked: decide once it has arrived.
                i += 1
                continue
            if not self.kv.fits_at_all(seq.num_computed_tokens + n):
                self.finish(seq, FinishReason.LENGTH)  # can never fit in this cache
                batch.finished.append(seq)
                continue
            seq.draft_token_ids = self._proposals(seq, n, budget)
            n += len(seq.draft_token_ids)
            if not self._reserve_running(seq, n, batch):
                break  # ``seq`` itself was preempted; everything after it already was
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _proposals(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """Tokens proposed for a decoding sequence to verify in this step: within the step's
        budget, its ``max_tokens`` and context, and the cache (none when it is not decoding)."""
        if self.propose is None or n != 1 or seq.num_pending \
                or seq.num_computed_tokens + 1 != seq.num_tokens:
            return []
        room = min(budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1,
                   (self.max_model_len or seq.num_tokens + budget) - seq.num_tokens - 1)
        if room <= 0:
            return []
        self.num_proposals_asked += 1
        drafts = self.propose(seq, room)
        # never a preemption for a proposal: only what the free blocks hold
        while drafts and self.kv.blocks_for(seq.num_tokens + len(drafts)) \
                - len(seq.block_ids) > self.kv.num_free_blocks:
            drafts.pop()
        return drafts

    def _length_done(self, seq: Sequence) -> bool:
        return (seq.num_output_tokens >= seq.params.max_tokens
                or (self.max_model_len is not None and seq.num_tokens >= self.max_model_len))

    def _last_pending(self, seq: Sequence) -> bool:
        """Its pending token is its last: it ends as that token arrives, with its blocks (a
        prefill replica's are then pushed), so it is never the one preempted."""
        return bool(seq.num_pending) and self._length_done(seq)

    def _reserve_running(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        while not self.kv.grow(seq, seq.num_computed_tokens + n):
            victim = next((s for s in reversed(self.running)
                           if s is seq or not self._last_pending(s)), self.running[-1])
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, behind: Sequence | None = None) -> None:
        """Free ``seq``'s blocks and queue it for recompute: in front of the waiting sequences
        of its priority, or right behind ``behind`` (a waiting sequence of its priority)."""
        self.kv.free(seq)
        seq.reset_for_recompute()
        if behind is None:
            _insert(self.waiting, seq, front=True)
        else:
            self.waiting.insert(self.waiting.index(behind) + 1, seq)
        self.num_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        # Sequences receiving their KV hold a slot too: once admitted they join the batch.
        computing = self.kv.uncommitted(self.running) if self.waiting else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while its last token was on the way
            if not self.kv.fits_at_all(seq.num_tokens):  # preempted, then grown past what this
                self.finish(self.waiting[0], FinishReason.LENGTH)  # cache can ever hold
                batch.finished.append(seq)
                continue
            if self.num_slots_taken >= self.max_num_seqs:
                freed = self._make_room(seq, batch, computing)  # a slot from a running one
                if freed is None:
                    break
                budget += freed
                continue
            hit = self.kv.match(seq)
            if hit.num_blocks < len(seq.block_hashes) and \
                    seq.block_hashes[hit.num_blocks] in computing:
                # Its next prompt block is being computed by a running sequence (the same
                # prompt: n sequences of one request, or concurrent requests with a shared
                # prefix): wait for it to land in the prefix cache instead of computing it too.
                deferred.append(self.waiting.popleft())
                continue
            computed = min(hit.num_tokens, seq.num_tokens - 1)
            n = min(seq.num_tokens - computed, budget)
            if not self.kv.allocate(seq, hit, computed + n):
                freed = self._make_room(seq, batch, computing)  # blocks from a running one
                if freed is None:
                    break
                budget += freed
                continue
            seq.num_computed_tokens = computed
            self.waiting.popleft()
            self._started(seq)
            computing.update(seq.block_hashes[seq.num_registered_blocks:])
            if seq.kv_load is not None:  # its blocks are still being filled from the host
                seq.status = SequenceStatus.LOADING
                self.loading[seq.request_id] = seq
                continue
            seq.status = SequenceStatus.RUNNING
            seq.admitted_time = self.clock()
            _insert(self.running, seq, front=False)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _admit_loaded(self) -> None:
        """Loading sequences whose blocks have landed join the running batch (scheduled in this
        step like the others; the step waits, on the device, for the copies they read)."""
        for seq in [s for s in self.loading.values() if self.kv.landed(s.kv_load)]:
            del self.loading[seq.request_id]
            self.kv.wait_for(seq.kv_load)
            seq.status = SequenceStatus.RUNNING
            seq.admitted_time = self.clock()
            _insert(self.running, seq, front=False)

    def _make_room(self, seq: Sequence, batch: ScheduledBatch, computing: set[int]) -> int | None:
        """A slot and blocks for the head of ``waiting`` (``seq``), taken from a running
        sequence: of a worse priority (:meth:`_displace`), else of the same priority for a
        sequence that has waited ``starvation_timeout_s`` (:meth:`_relieve_starvation`).
        Returns the step budget given back, or None when no running sequence may give way."""
        freed = self._displace(seq, batch)
        if freed is None:
            freed = self._relieve_starvation(batch, computing)
        return freed

    def _displace(self, seq: Sequence, batch: ScheduledBatch) -> int | None:
        """Preempt the newest running sequence of the worst priority if it is worse than
        ``seq``'s (vLLM's priority policy), taking it out of this step if it was in it; returns
        the step budget it gave back, or None when no running sequence ranks below ``seq``."""
        victim = next((s for s in reversed(self.running) if not self._last_pending(s)), None)
        if victim is None or victim.params.priority <= seq.params.priority:
            return None
        freed = self._unschedule(victim, batch)
        self._preempt(victim)
        return freed

    def _relieve_starvation(self, batch: ScheduledBatch, computing: set[int]) -> int | None:
        """The bounded wait (module docstring): if the first never-scheduled waiting sequence of
        the head's priority has waited ``starvation_timeout_s``, move it to the head and preempt
        for it the running sequence of its priority with the most output tokens among those
        that have run that long since admitted, putting the victim right behind it. Returns
        the step budget the victim gave back, or None (nothing changed)."""
        bound = self.starvation_timeout_s
        if bound is None or not self.running:
            return None
        priority = self.waiting[0].params.priority
        starved = next((s for s in self.waiting if s.params.priority != priority
                        or s.scheduled_time is None), None)
        now = self.clock()
        if starved is None or starved.params.priority != priority \
                or now - starved.arrival_time < bound:
            return None
        hit = self.kv.match(starved)
        if hit.num_blocks < len(starved.block_hashes) and \
                starved.block_hashes[hit.num_blocks] in computing:
            return None  # it would wait for a running sequence's block anyway (see above)
        victim = max((s for s in self.running if s.params.priority == priority
                      and self._may_give_way(s, now, bound)),
                     key=lambda s: s.num_output_tokens, default=None)
        if victim is None:
            return None
        if starved is not self.waiting[0]:  # behind sequences preempted earlier
            self.waiting.remove(starved)
            self.waiting.appendleft(starved)
        freed = self._unschedule(victim, batch)
        self._preempt(victim, behind=starved)
        self.num_starvation_preemptions += 1
        return freed

    def _may_give_way(self, seq: Sequence, now: float, bound: float) -> bool:
        """Whether running ``seq`` may be preempted for a starving sequence: it has run
        ``bound`` seconds since it was last admitted, is decoding (not prefilling or
        recomputing: one token to compute) and its pending token, if any, is not its last."""
        return (seq.admitted_time is not None and now - seq.admitted_time >= bound
                and seq.num_tokens - seq.num_computed_tokens == 1
                and not self._last_pending(seq))

    def _unschedule(self, victim: Sequence, batch: ScheduledBatch) -> int:
        """Take ``victim`` out of ``running`` and, if it was in it, out of this step's batch;
        return the step budget it gave back."""
        self.running.remove(victim)
        if victim not in batch.seqs:
            return 0
        i = batch.seqs.index(victim)
        del batch.seqs[i]
        return batch.num_new_tokens.pop(i)

    def _started(self, seq: Sequence) -> None:
        if seq.scheduled_time is None:  # not again after a preemption (vLLM's queue time)
            seq.scheduled_time = self.clock()
            self.queue_times.append(seq.scheduled_time - seq.arrival_time)

    # -- after the forward pass -------------------------------------------------------------
    def advance(self, batch: ScheduledBatch) -> list[Sequence]:
        """Account the computed chunks; return the sequences that are due a sampled token."""
        due = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # proposals count once verified (engine.step_update), their KV kept or not
            seq.num_computed_tokens += n - len(seq.draft_token_ids)
            self.kv.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                due.append(seq)
        return due


def _insert(queue, seq: Sequence, front: bool) -> None:
    """Put ``seq`` among the sequences of its priority: behind them (``front=False``) or before
    them; a queue of one priority is plain FIFO (append / appendleft)."""
    p = seq.params.priority
    if front:  # before the first of its priority or a worse one
        i = next((k for k, o in enumerate(queue) if o.params.priority >= p), len(queue))
    elif not queue or queue[-1].params.priority <= p:  # the usual case: at the end
        i = len(queue)
    else:  # before the first of a worse priority
        i = next(k for k, o in enumerate(queue) if o.params.priority > p)
    queue.insert(i, seq)
