"""The engine: requests in, tokens out. ``step()`` is schedule → launch → resolve.

Its parts, as vLLM v1 splits them: input processing (:class:`~engine.input_processor.
InputProcessor`: tokenize, check, a grammar's matcher), the core step (the :class:`~engine.
scheduler.Scheduler`, the :class:`~engine.sampler.Sampler`, and :class:`~engine.step_update.
StepUpdater` for the update from a step's output), and the executor over the model's ranks
(:class:`~engine.executor.Executor`). This class joins them and adds the two roles' verbs
(reserve / admit for decode, held blocks for prefill).

*Launch* queues a step on the device: the forward pass, sampling, and a copy of the sampled ids
to pinned host memory; the sequences due a token get a pending placeholder
(:mod:`engine.sequence`). *Resolve* waits for a launched step, fills in its tokens, checks stop
conditions and makes the outputs. With ``async_scheduling`` (the default) ``step()`` launches
step N+1 before it resolves step N, so the host's work (scheduling, inputs, planning, launching,
stop checks, outputs) runs while the device computes, and a decode step's inputs come straight
from the previous step's sampled ids on the device. The cost: a sequence that stops on a token
(EOS, a stop token) has already been fed to one more step, whose result is dropped.

The engine stops on token ids only (EOS, ``stop_token_ids``, ``max_tokens``, the context) and never
decodes text: an output carries the step's new tokens, and stop strings belong to whoever turns
tokens into text (:class:`~engine.outputs.OutputCollector` offline, the ingress when serving),
which aborts the request when one appears.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.cuda_graph import ARGMAX_MAX_ROWS, graphs_draw
from engine import draft_model
from engine.draft_model import DraftProposer
from engine.errors import BadRequest, RequestIdInUse
from engine.executor import Executor
from engine.input_processor import InputProcessor, Prompt
from engine.kv_cache_manager import KVCacheManager
from engine.kv_offload import HostTier
from engine.kv_layout import KVCacheSpec, KVLayout
from engine.outputs import RequestOutput, TopLogprobs
from engine.sampler import Draw, SampleOutput, Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.spec_decode import (PROBE_SEQS, NgramProposer, SpecController, SpecStats,
                                verified_logprobs, verify)
from engine.step_cost import StepCost
from engine.step_update import LaunchedStep, StepUpdater

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "KVCacheSpec", "LLMEngine", "LaunchedStep", "Prompt"]


@dataclass
class EngineStats:
    """Counters since the engine started: steps, seconds spent inside ``step()``, tokens
    scheduled (prompt and decode), output tokens produced, prompt tokens of the requests taken
    (a disaggregated request counts in both roles' engines); the steps that carried prompt
    tokens and their seconds (with the engine one step ahead, a step's seconds are its launch
    and the wait for the step before it)."""

    steps: int = 0
    step_seconds: float = 0.0
    prompt_steps: int = 0
    prompt_step_seconds: float = 0.0
    scheduled_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        self.executor = Executor(config)
        ex = self.executor
        self.processor = InputProcessor(ex.source, ex.max_model_len, config.block_size)
        self.pool = BlockPool(ex.runner.num_blocks, config.enable_prefix_caching)
        self.host_tier: HostTier | None = None
        if config.kv_offloading_size:
            # The size is the total over the ranks; each holds its slice of every block.
            blocks = int(config.kv_offloading_size * 2**30
                         // (ex.runner.block_bytes * config.tensor_parallel_size))
            self.host_tier = HostTier(blocks)
            ex.allocate_host_tier(blocks)
        self.kv_manager = KVCacheManager(self.pool, config.block_size, self.host_tier,
                                         ex.copies_done)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, ex.max_model_len,
                                   starvation_timeout_s=config.starvation_timeout_s)
        self.sampler = Sampler(ex.device, config.seed)
        self.spec_stats = SpecStats()  # speculative decoding's acceptance (engine.spec_decode)
        self.spec: SpecController | None = None
        # draft_model: the scheduler makes room for k proposals (placeholders), which the draft
        # fills before the step is launched (engine.draft_model)
        self.drafter: DraftProposer | None = None
        if (spec := config.speculative_config) is not None:
            k = spec.num_speculative_tokens
            if ex.draft is not None:
                self.drafter = DraftProposer(ex.draft, config.max_num_batched_tokens)
                self.propose = lambda seq, limit: [0] * min(k, limit)
            else:
                proposer = NgramProposer(spec)
                self.propose = lambda seq, limit: proposer.propose(seq.token_ids, limit)
            self.spec = SpecController()
        self.updater = StepUpdater(self.scheduler, self.kv_manager,
                                   self.processor.eos_token_ids, ex.max_model_len)
        self._running_step: LaunchedStep | None = None  # launched, not yet resolved
        self.stats = EngineStats()
        # (seconds, sequences) of recent steps, drained by a metrics reader (bounded: unread
        # samples are dropped, never piled up).
        self.step_samples: deque[tuple[float, int]] = deque(maxlen=4096)
        self.step_cost = StepCost(self.device)
        self.startup_s = time.perf_counter() - t0
        log.info("engine ready in %.1fs (%s, %s, weights %s, KV cache %s, attention %s, "
                 "warm-up %.1fs)", self.startup_s, self.device, str(self.dtype)[6:],
                 self.weights_name, str(self.runner.kv_dtype)[6:], self.runner.backend.name,
                 self.runner.warm_up_s)

    # -- what the parts know ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.dtype

    @property
    def max_model_len(self) -> int:
        return self.executor.max_model_len

    @property
    def source(self):
        return self.executor.source

    @property
    def runner(self):
        return self.executor.runner

    @property
    def model(self):
        return self.executor.model

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:  # the sampler's and the stop checks'
        self.processor.eos_token_ids = self.updater.eos_token_ids = frozenset(ids)

    @property
    def grammars(self):
        return self.processor.grammars

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    @property
    def weights_name(self) -> str:
        """What the linear layers hold: ``fp8 (<source>, <format>)`` or the compute dtype."""
        scheme = self.model.quantization
        return scheme.name if scheme is not None else str(self.dtype).removeprefix("torch.")

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache and its layout, for a transfer endpoint (``kvtransfer.endpoint_for``).
        With tensor parallelism every rank's cache is in it (the other ranks share theirs with
        this process the first time this is asked)."""
        cfg = self.source.config
        caches, handles = self.executor.kv_caches()
        layout = KVLayout(model=self.source.model_id,
                          dtype=str(self.runner.kv_dtype).removeprefix("torch."),
                          num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                          head_dim=cfg.head_dim, block_size=self.config.block_size,
                          tp_size=len(caches))
        return KVCacheSpec(layout, caches, handles)

    # -- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.processor.tokenize(prompt, self.pool.num_usable_blocks)

    def validate_params(self, params: SamplingParams) -> None:
        self.processor.validate_params(params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, hold_blocks: bool = False) -> str:
        """Queue a request. ``hold_blocks`` (prefill role): keep its KV blocks when it finishes,
        until :meth:`release_held_blocks`; :meth:`held_blocks` lists them."""
        seq = self._new_sequence(prompt, params, request_id)
        seq.hold_blocks = hold_blocks
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt: Prompt, params: SamplingParams | None,
                      request_id: str | None) -> Sequence:
        if request_id is not None and (self.scheduler.find(request_id) is not None
                                       or request_id in self.scheduler.held):
            raise RequestIdInUse(f"request_id: {request_id!r} is already in use")
        seq = self.processor.sequence(prompt, params, request_id or uuid.uuid4().hex,
                                      self.pool.num_usable_blocks)
        self.stats.prompt_tokens += seq.num_prompt_tokens
        if seq.params.seed is not None:
            seq.generator = self.sampler.new_generator()
        return seq

    # -- prefill role -----------------------------------------------------------------------
    def held_blocks(self, request_id: str) -> list[int]:
        """The KV blocks of a finished ``hold_blocks`` request, in token order."""
        return list(self.scheduler.held.get(request_id, ()))

    def release_held_blocks(self, request_id: str) -> None:
        """Give the blocks back; their full blocks stay prefix-cache hits."""
        self.scheduler.release_held(request_id)

    # -- decode role ------------------------------------------------------------------------
    def reserve(self, prompt: Prompt, params: SamplingParams | None = None,
                request_id: str | None = None) -> tuple[str, list[int], int] | None:
        """Reserve KV blocks for a prompt whose KV another engine will push.

        Returns ``(request_id, block ids to fill, tokens already present)``: the blocks start at
        the first block the local prefix cache does not hold. None when blocks or sequence
        slots are short right now (nothing is taken). Then :meth:`admit` or
        :meth:`abort_request`."""
        seq = self._new_sequence(prompt, params, request_id)
        self._fence_released_blocks()
        if not self.scheduler.reserve(seq):
            self.stats.prompt_tokens -= seq.num_prompt_tokens  # counted when it comes back
            return None
        # Another engine writes these blocks: what the host tier keeps of their old KV is
        # copied out (on every rank) before they are handed over.
        self._queue_kv_copies(wait=True)
        skip = seq.num_present_tokens // self.config.block_size
        return seq.request_id, seq.block_ids[skip:], seq.num_present_tokens

    def admit(self, request_id: str, first_token: int, first_logprob: float | None = None,
              first_top: TopLogprobs | None = None) -> RequestOutput | None:
        """The pushed KV has landed and the prefill engine sampled ``first_token`` (with its
        logprob and top logprobs where asked): join the running batch (or finish at once if
        that token ends the request). None when the request took its first token ahead of
        its KV (:meth:`take_handed_first_token`): it joins with that one, nothing new."""
        seq = self.scheduler.transferring.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} has no reserved blocks")
        taken = seq.num_output_tokens > 0
        if not taken:
            self._check_token(first_token)
        self.scheduler.admit_transferred(seq)
        return None if taken else self._take(seq, first_token, first_logprob, first_top)

    def take_handed_first_token(self, request_id: str, first_token: int,
                                first_logprob: float | None = None,
                                first_top: TopLogprobs | None = None) -> RequestOutput | None:
        """A request whose KV is still landing takes the first token the prefill engine sampled
        (sent ahead of the KV), to be published at once; :meth:`admit` then adds nothing. None
        (nothing changed) when the request is not waiting for its KV, has a first token, or
        that token might end it (a stop, its length, a grammar): that one comes with the
        admission, so blocks still being written are never given back early."""
        seq = self.scheduler.transferring.get(request_id)
        if seq is None or seq.num_output_tokens or not 0 <= first_token < self.vocab_size \
                or self.updater.may_end(seq, first_token):
            return None
        return self._take(seq, first_token, first_logprob, first_top)

    def take_first_token(self, request_id: str, first_token: int,
                         first_logprob: float | None = None,
                         first_top: TopLogprobs | None = None) -> RequestOutput | None:
        """A request still queued here, none of it computed, takes the first token another
        engine sampled for its prompt (a decode replica with no room yet: the prefill replica's
        answer is published at once). The request then waits as a preempted one does, its
        prompt and that token to be computed here. None (nothing changed) when the request is
        gone or has started here: its own first token is on the way or out."""
        seq = self.scheduler.find(request_id)
        if seq is None or seq.status is not SequenceStatus.WAITING or seq.num_output_tokens \
                or seq.num_pending:
            return None
        self._check_token(first_token)
        return self._take(seq, first_token, first_logprob, first_top)

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise BadRequest(f"first_token: {token} is outside the vocabulary")

    def _take(self, seq: Sequence, token: int, logprob: float | None,
              top: TopLogprobs | None) -> RequestOutput:
        """``seq`` takes a token sampled elsewhere (one that ends it finishes it here): its
        output, with the logprobs it asked for."""
        self.updater.append(seq, token)
        asked = seq.params.logprobs is not None
        return self.updater.output(seq, [token], [logprob] if asked else None,
                                   [top or []] if asked and seq.params.logprobs else None)

    def _fence_released_blocks(self) -> None:
        """Blocks given back since the running step was launched may still be written by it (a
        sequence that stopped while it was in flight). Before another engine is let write into
        blocks from the pool, wait for that step, so its late writes cannot land on theirs."""
        step = self._running_step
        if step is not None and self.scheduler.num_releases != step.releases:
            step.wait()
            step.releases = self.scheduler.num_releases

    # -- lifecycle --------------------------------------------------------------------------
    def check_ranks(self) -> None:
        """Raise if a rank of a tensor-parallel engine is gone."""
        self.executor.check_ranks()

    def kill_ranks(self) -> None:
        """Kill the other ranks of a tensor-parallel engine at once (any thread; the process
        is about to exit)."""
        self.executor.kill_ranks()

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do otherwise)."""
        self.executor.shutdown()

    def reset_prefix_cache(self) -> int:
        """Make every cached block that no request holds a miss again (vLLM's
        ``reset_prefix_cache``): benchmarks that replay prompts start each point cold."""
        if self.host_tier is not None:
            self.host_tier.clear()
            # Blocks losing their hash may still be copying: let every copy land, everywhere.
            self.executor.copy_blocks(self.kv_manager.drain_copies(), wait=True)
            self.kv_manager.forget_copies()
        return self.pool.reset_prefix_cache()

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def set_aside(self, request_id: str, key: str) -> bool:
        """Abort ``request_id`` but keep its blocks out of use under ``key`` until
        :meth:`release_held_blocks` (decode role: a hand-over's blocks a late write may still
        land in), so its id is free for another run at once."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT, hold_as=key)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._running_step is not None

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        # Speculative decoding: a step that looks for proposals does not run ahead, and it can
        # propose only once no step is running (its sequences' last tokens known).
        speculate = self.spec is not None and self.spec.wants()
        proposing = speculate and self._running_step is None
        self.scheduler.propose = (self.propose if self.spec.on else self._probe()) \
            if proposing else None
        asked = self.scheduler.num_proposals_asked
        drafted, accepted = self.spec_stats.num_draft_tokens, self.spec_stats.num_accepted_tokens
        batch = self.scheduler.schedule()
        outputs = [self.updater.output(s, [], None) for s in batch.finished]
        on_device = None  # the draft's proposals, where they stay on the device
        if self.drafter is not None and proposing \
                and (speculating := [s for s in batch.seqs if s.draft_token_ids]):
            on_device = self.drafter.propose(speculating, self._grammars_for(speculating),
                                           on_device=self._drafts_stay_on_device(batch.seqs))
        if self.drafter is not None:  # a step ahead serves the step after its own alone
            self.drafter.ahead = None
        self._queue_kv_copies()
        if not batch and self._running_step is None and self.scheduler.loading:
            self.executor.sync_copies()  # nothing else to run: wait for the host tier's copies
        launched = self._launch(batch, on_device) if batch else None
        due = [self._running_step] if self._running_step is not None else []
        self._running_step = None
        if self.config.async_scheduling and not speculate:
            self._running_step = launched
        elif launched is not None:
            due.append(launched)
        looked = proposing and self.scheduler.num_proposals_asked > asked  # one could propose
        was_on = self.spec is not None and self.spec.on
        if self.spec is not None:
            self.spec.stepped(looked)
        if looked:
            self.spec.update(self.spec_stats.num_draft_tokens - drafted,
                             self.spec_stats.num_accepted_tokens - accepted)
        for step in due:
            outputs += self.updater.resolve(step)
            if step.started is not None and step.done_at is not None:
                self.step_cost.record(step.started, step.done_at, step.prompt_tokens)
        elapsed = time.perf_counter() - t0
        if self.spec is not None and launched is not None and not launched.prompt_tokens:
            self._time_spec(looked, was_on, due, launched, elapsed, outputs)
        self._count(batch, outputs, elapsed, launched.prompt_tokens if launched is not None else 0)
        return outputs

    def _drafts_stay_on_device(self, seqs: list[Sequence]) -> bool:
        """Whether the target's step can take the draft's proposals on the device, the host
        not waiting for them (:meth:`engine.draft_model.DraftProposer.propose`): one rank (the
        others would need them sent), no grammar to mask the draft's steps with, and no logits
        processor that reads a verified row's tokens."""
        return self.config.tensor_parallel_size == 1 and not any(
            s.matcher is not None or s.params.changes_logits for s in seqs)

    def _plain_draws(self, seqs: list[Sequence]) -> list[Draw] | None:
        """Where every sequence's next token is drawn from its raw logits alone, nothing else
        asked of the draw (no penalty, bias, ``min_tokens``, grammar or logprobs), on an engine
        of one rank without speculation, each sequence's :class:`~engine.sampler.Draw`
        (:meth:`Sampler.draw_of`: greedy, or a temperature cut or not to a top-k and top-p). A
        decode graph may then take the tokens itself (:class:`engine.cuda_graph.DecodeGraphs`),
        and its ids are the step's tokens. None otherwise. Only asked of a batch such a graph
        can take (``ARGMAX_MAX_ROWS``): a large batch's sequences are not walked every step for
        nothing."""
        if len(seqs) > ARGMAX_MAX_ROWS or not graphs_draw(self.config):
            return None
        draws = []
        for s in seqs:
            p = s.params
            if p.changes_logits or s.matcher is not None or p.logprobs is not None \
                    or (draw := self.sampler.draw_of(s)) is None:
                return None
            draws.append(draw)
        return draws

    def _grammars_for(self, seqs: list[Sequence]):
        """The grammars where one of ``seqs`` has a matcher, else None (they are built on first
        use: a run without structured outputs never needs xgrammar)."""
        return self.grammars if any(s.matcher for s in seqs) else None

    def _probe(self):
        """``propose`` for a look while speculation is off: ``PROBE_SEQS`` sequences at most."""
        left = [PROBE_SEQS]

        def propose(seq: Sequence, limit: int) -> list[int]:
            if not left[0]:
                return []
            left[0] -= 1
            return self.propose(seq, limit)
        return propose

    def _time_spec(self, looked: bool, was_on: bool, due: list[LaunchedStep],
                   launched: LaunchedStep, elapsed: float, outputs: list[RequestOutput]) -> None:
        """Give the speculation controller a decode step's wall time: one that speculated
        (and the tokens a sequence it made; a look while speculation was off is a probe), or
        one without speculation that ran ahead after one that did the same (launched, and
        waited for the step before: a whole step's time)."""
        if looked:
            made = sum(len(o.new_token_ids) for o in outputs)
            self.spec.timed(True, elapsed, made / max(len(launched.due), 1), probe=not was_on)
        elif self._running_step is launched and due and not due[0].prompt_tokens:
            self.spec.timed(False, elapsed)

    def _count(self, batch: ScheduledBatch, outputs: list[RequestOutput], elapsed: float,
               prompt_tokens: int) -> None:
        stats = self.stats
        stats.steps += 1
        stats.step_seconds += elapsed
        self.step_samples.append((elapsed, len(batch.seqs)))
        stats.scheduled_tokens += batch.num_tokens
        if prompt_tokens:  # (a step verifying proposals computes several tokens a sequence)
            stats.prompt_steps += 1
            stats.prompt_step_seconds += elapsed
        stats.output_tokens += sum(len(o.new_token_ids) for o in outputs)

    def _launch(self, batch: ScheduledBatch, drafted: torch.Tensor | None = None
                ) -> LaunchedStep:
        """Queue the batch, its sampling and the copy of the sampled ids; nothing waits (but
        a verification, which waits for its step). ``drafted``: the draft's proposals on the
        device (a speculating step runs alone: no step is running to take pending inputs
        from, so the proposals take that place)."""
        running = self._running_step
        prev = running.tokens if running is not None else drafted
        prompt_tokens = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens)
                            if s.num_computed_tokens < s.num_prompt_tokens)
        started = self.step_cost.mark()
        logits = self.executor.execute(batch, prev, draws=self._plain_draws(batch.seqs))
        due = self.scheduler.advance(batch)
        step = LaunchedStep(due, started=started, prompt_tokens=prompt_tokens)
        if (p := self.runner.prompt_out) is not None:
            p.logprobs, p.top_ids, p.top_logprobs = (self._to_host(t) for t in (
                p.logprobs, p.top_ids, p.top_logprobs))
            step.prompt = p
        if due and any(s.draft_token_ids for s in due):  # the others verify their one row
            drafts = [s.draft_token_ids for s in due]
            step.spec, step.tokens = verify(
                self.sampler, logits, due, drafts, self.spec_stats, self.eos_token_ids,
                self._grammars_for(due), drafted=drafted,
                before_wait=self._step_ahead(step, drafts)
                if drafted is not None and draft_model.AHEAD else None)
            if any(s.params.logprobs is not None for s in due):
                step.spec_logprobs = verified_logprobs(logits, due, drafts, step.spec)
            self.executor.share_tokens(step.tokens)
            for row, seq in enumerate(due):
                seq.add_pending(row)
                seq.draft_token_ids, seq.draft_rows = [], None
        elif due:
            out = SampleOutput(self.runner.sampled) if self.runner.sampled is not None else \
                self.sampler(logits, due, prev, self.eos_token_ids, self._grammars_for(due))
            step.tokens = out.tokens
            self.executor.share_tokens(out.tokens)  # the other ranks' next pending inputs
            host = self.runner.sampled_host  # (a graph that wrote the ids to the host itself)
            step.host_tokens = host if host is not None else self._to_host(out.tokens)
            step.host_logprobs, step.host_top_ids, step.host_top_logprobs = (
                self._to_host(t) for t in (out.logprobs, out.top_ids, out.top_logprobs))
            for row, seq in enumerate(due):
                seq.add_pending(row)
        if step.done_at is None:  # (a step ahead marks the verification's end before it)
            step.done_at = self.step_cost.mark()
        if self.device.type == "cuda":
            step.done = step.done_at
        step.releases = self.scheduler.num_releases
        return step

    def _step_ahead(self, step: LaunchedStep, drafts: list[list[int]]):
        """What queues the draft's next step behind the verification ``step`` (its
        ``before_wait``, :meth:`engine.draft_model.DraftProposer.launch_ahead`): for each
        sequence that verifies proposals, once its blocks hold the position after its last
        proposal (taken from the free blocks now: a step that keeps every proposal writes
        there next) and the context allows it. The step's end is marked before it, so that
        waiting for the verification never waits for the step ahead."""
        def launch(kept: torch.Tensor, drawn: torch.Tensor, proposed: torch.Tensor) -> None:
            step.done_at = self.step_cost.mark()
            chosen, row = [], 0
            for seq, d in zip(step.due, drafts):
                if d and seq.num_tokens + len(d) < self.max_model_len \
                        and self.kv_manager.grow(seq, seq.num_tokens + len(d) + 1):
                    chosen.append((row, seq, len(d)))
                row += 1 + len(d)
            self.drafter.launch_ahead(chosen, kept, drawn, proposed)
        return launch

    def _queue_kv_copies(self, wait: bool = False) -> None:
        """Queue the host tier's block copies on every rank (before the step that the
        scheduling which asked for them launches); ``wait``: when the blocks handed out
        since the last call were still being copied, until every copy has landed, on every
        rank (another engine is about to write them)."""
        if self.host_tier is None:
            return
        copies = self.kv_manager.drain_copies()
        if copies:
            self.executor.copy_blocks(copies, wait=wait and bool(copies.waits))

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.device.type != "cuda":
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
