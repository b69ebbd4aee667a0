"""Continuous batching with chunked prefill under a token budget and preemption by recompute.

Queues: ``waiting`` (FIFO; preempted sequences go back to its front) → ``running`` (admission
order, which is also priority: the most recently admitted is preempted first).

Each step spends ``max_num_batched_tokens``: running sequences first (one token each when
decoding, the next chunk when still prefilling), then waiting sequences are admitted while
budget, ``max_num_seqs`` and free blocks allow. Admission matches the prefix cache; a full hit
still recomputes the last prompt token (its KV is not stored again). A waiting sequence whose
next prompt block a running sequence is computing right now is held back until that block is in
the cache (so n sequences of one prompt, or a burst of requests with a shared prefix, compute
it once). When a running sequence
needs a block and none is free, the last-admitted sequence is preempted: its blocks are freed
(and stay prefix-cache hits) and it is recomputed later.

Pending tokens (the engine runs one step ahead, :mod:`engine.sequence`): a running sequence whose
pending token is its last (``max_tokens``, the model's context) or would not fit the cache waits
for that token to arrive instead of being scheduled; a preempted sequence is not admitted again
before its pending token arrives; only known tokens are hashed for the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool, hash_blocks
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
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int | None = None):
        self.pool = pool
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.transferring: dict[str, Sequence] = {}  # decode role: awaiting pushed KV
        self.held: dict[str, list[int]] = {}  # prefill role: finished, blocks kept for a push
        self.num_preemptions = 0
        self.num_releases = 0  # sequences whose blocks went back to the pool, ever
        self.finished_by_reason: dict[str, int] = {}  # sequences ended, ever, by reason
        # Seconds from arrival to first scheduling, of sequences not yet read by the metrics.
        self.queue_times: deque[float] = deque(maxlen=4096)

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        if request_id in self.transferring:
            return self.transferring[request_id]
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is and give its blocks back (or, for a prefill-role
        sequence that finished normally, keep them in ``held`` until :meth:`release_held`)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.transferring.pop(seq.request_id, None)
        seq.drop_pending()
        if seq.hold_blocks and reason is not FinishReason.ABORT and seq.block_ids:
            self.held[seq.request_id] = seq.block_ids
            seq.block_ids = []
        else:
            self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.finished_by_reason[reason.value] = self.finished_by_reason.get(reason.value, 0) + 1

    def release_held(self, request_id: str) -> None:
        blocks = self.held.pop(request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    # -- decode role: KV arrives by transfer ----------------------------------------------------
    def reserve(self, seq: Sequence) -> bool:
        """Match the prefix cache and reserve blocks for the rest of ``seq``'s prompt, outside
        the running batch. False (nothing taken) when blocks or sequence slots are short."""
        if len(self.running) + len(self.transferring) >= self.max_num_seqs:
            return False
        hits, hit_tokens = self._match(seq)
        need = -(-seq.num_tokens // self.block_size) - len(hits)
        if need + self.pool.num_blocks_to_touch(hits) > self.pool.num_free_blocks:
            return False
        self._take(seq, hits, hit_tokens, need)
        seq.num_computed_tokens = seq.num_present_tokens
        seq.status = SequenceStatus.TRANSFERRING
        self.transferring[seq.request_id] = seq
        self._started(seq)
        return True

    def admit_transferred(self, seq: Sequence) -> None:
        """The KV of every prompt token is in ``seq``'s blocks: join the running batch."""
        del self.transferring[seq.request_id]
        seq.num_computed_tokens = seq.num_tokens
        self.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids[::-1])
        seq.block_ids = []
        self.num_releases += 1

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.num_pending and (self._length_done(seq) or seq.matcher is not None
                                    or self._blocks_needed(seq, n) > self.pool.num_usable_blocks):
                # Its pending token is its last, or its grammar must see it before the next
                # draw can be masked: decide once it has arrived.
                i += 1
                continue
            if self._blocks_needed(seq, n) > self.pool.num_usable_blocks:
                self.finish(seq, FinishReason.LENGTH)  # can never fit in this cache
                batch.finished.append(seq)
                continue
            if not self._reserve_running(seq, n, batch):
                break  # ``seq`` itself was preempted; everything after it already was
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _length_done(self, seq: Sequence) -> bool:
        return (seq.num_output_tokens >= seq.params.max_tokens
                or (self.max_model_len is not None and seq.num_tokens >= self.max_model_len))

    def _reserve_running(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        while True:
            extra = self._blocks_needed(seq, n) - len(seq.block_ids)
            if extra <= self.pool.num_free_blocks:
                seq.block_ids += self.pool.allocate(max(extra, 0))
                return True
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        # Sequences receiving their KV hold a slot too: once admitted they join the batch.
        computing = self._blocks_in_flight()
        deferred: list[Sequence] = []
        while (self.waiting and budget > 0
               and len(self.running) + len(self.transferring) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while its last token was on the way
            hits, hit_tokens = self._match(seq)
            if len(hits) < len(seq.block_hashes) and seq.block_hashes[len(hits)] in computing:
                # Its next prompt block is being computed by a running sequence (the same
                # prompt: n sequences of one request, or concurrent requests with a shared
                # prefix): wait for it to land in the prefix cache instead of computing it too.
                deferred.append(self.waiting.popleft())
                continue
            computed = min(hit_tokens, seq.num_tokens - 1)
            n = min(seq.num_tokens - computed, budget)
            need = -(-(computed + n) // self.block_size) - len(hits)
            if need + self.pool.num_blocks_to_touch(hits) > self.pool.num_free_blocks:
                break
            self._take(seq, hits, hit_tokens, need)
            seq.num_computed_tokens = computed
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            self._started(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            computing.update(seq.block_hashes[seq.num_registered_blocks:])
        self.waiting.extendleft(reversed(deferred))

    def _started(self, seq: Sequence) -> None:
        if seq.scheduled_time is None:  # not again after a preemption (vLLM's queue time)
            seq.scheduled_time = time.monotonic()
            self.queue_times.append(seq.scheduled_time - seq.arrival_time)

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of full prompt blocks that running sequences are still computing."""
        if not self.pool.enable_prefix_caching or not self.waiting:
            return set()
        return {h for seq in self.running if seq.num_registered_blocks < len(seq.block_hashes)
                for h in seq.block_hashes[seq.num_registered_blocks:]}

    def _match(self, seq: Sequence) -> tuple[list[int], int]:
        self._update_hashes(seq)
        hits = self.pool.match_prefix(seq.block_hashes)
        return hits, min(len(hits) * self.block_size, seq.num_tokens)

    def _take(self, seq: Sequence, hits: list[int], hit_tokens: int, need: int) -> None:
        """Reference the prefix hits and allocate ``need`` more blocks for ``seq``."""
        self.pool.touch(hits)
        self.pool.record_lookup(seq.num_tokens, hit_tokens)
        seq.block_ids = hits + self.pool.allocate(max(need, 0))
        seq.num_present_tokens = hit_tokens
        seq.num_cached_tokens = hit_tokens
        seq.num_registered_blocks = len(hits)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return -(-(seq.num_computed_tokens + n) // self.block_size)

    # -- after the forward pass -------------------------------------------------------------
    def advance(self, batch: ScheduledBatch) -> list[Sequence]:
        """Account the computed chunks; return the sequences that are due a sampled token."""
        due = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                due.append(seq)
        return due

    def _update_hashes(self, seq: Sequence) -> None:
        have = len(seq.block_hashes)
        known = seq.num_resolved_tokens
        if known // self.block_size > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += hash_blocks(seq.token_ids[:known], self.block_size, parent, have)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks filled with computed KV of known tokens to the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks or not self.pool.enable_prefix_caching:
            return
        self._update_hashes(seq)
        num_full = min(num_full, len(seq.block_hashes))
        for b in range(seq.num_registered_blocks, num_full):
            self.pool.cache_block(seq.block_ids[b], seq.block_hashes[b])
        seq.num_registered_blocks = num_full
