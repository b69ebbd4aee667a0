"""The engine: requests in, tokens out. ``step()`` is schedule → launch → resolve.

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

import functools
import json
import logging
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.config import EngineConfig, parse_dtype
from engine.errors import BadRequest
from engine.loader import load_model, load_tokenizer, resolve_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput, TopLogprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import FinishReason, Sequence
from engine.structured import Grammars
from engine.parallel import TPGroup, broadcast, building, check_tp
from engine.tp_worker import TPWorkers
from engine.validation import RequestChecks

log = logging.getLogger(__name__)

Prompt = str | Seq[int]


@dataclass
class EngineStats:
    """Counters since the engine started: steps, seconds spent inside ``step()``, tokens
    scheduled (prompt and decode), output tokens produced, prompt tokens of the requests taken
    (a disaggregated request counts in both roles' engines)."""

    steps: int = 0
    step_seconds: float = 0.0
    scheduled_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True)
class KVCacheSpec:
    """An engine's paged KV cache as a transfer layer needs it: the cache, indexed ``[layer,
    block, K/V, kv head, slot, head dim]`` over block-major memory (one block of every layer is
    one contiguous region), and what names its layout (``dtype`` as ``"bfloat16"``;
    ``num_kv_heads``: the model's). A tensor-parallel engine has one cache per rank, each with
    ``num_kv_heads / tp_size`` heads (rank r the r-th slice) under the same block ids:
    ``rank_caches`` lists them, rank 0's (``kv_cache``) first, and ``rank_handles`` how another
    process opens each on a GPU (a worker rank's own CUDA IPC handle; None for rank 0, whose
    cache is this process's own and shared as it is)."""

    kv_cache: torch.Tensor
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    rank_caches: tuple = ()
    rank_handles: tuple = ()

    @property
    def caches(self) -> tuple:
        """Every rank's cache, rank 0's first."""
        return self.rank_caches or (self.kv_cache,)

    @property
    def tp_size(self) -> int:
        return len(self.caches)


@dataclass
class LaunchedStep:
    """A step queued on the device: the sequences due a token (row ``i`` of ``tokens``), the
    sampled ids on the device, their host copies (valid once ``done`` has fired)."""

    due: list[Sequence]
    tokens: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    host_logprobs: torch.Tensor | None = None
    host_top_ids: torch.Tensor | None = None
    host_top_logprobs: torch.Tensor | None = None
    prompt: object | None = None  # model_runner.PromptLogprobs, host copies
    done: torch.cuda.Event | None = None
    releases: int = 0  # the scheduler's release count right after the launch

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


def engine_shape(config: EngineConfig, device: torch.device):
    """``(source, device, dtype, max_model_len)`` of an engine (and of each of its ranks)."""
    source = resolve_model(config.model)
    mcfg = source.config
    if config.dtype is not None:
        dtype = parse_dtype(config.dtype)
    else:
        dtype = parse_dtype(mcfg.torch_dtype) if device.type == "cuda" else torch.float32
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                        mcfg.max_position_embeddings)
    return source, device, dtype, max_model_len


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels launch on the current device
        # Tensor parallelism: this process is rank 0; the other ranks are worker processes
        # that run every step with it (engine.tp_worker) and receive each step's sampled
        # tokens (the next step's pending inputs) by broadcast.
        self.source, _, self.dtype, self.max_model_len = engine_shape(config, self.device)
        self.tp_workers = None
        if config.tensor_parallel_size > 1:
            check_tp(self.source.config, config.tensor_parallel_size)
            self.tp_workers = TPWorkers(config)
            weakref.finalize(self, self.tp_workers.close)  # the workers stop with the engine
        group = self.tp_workers.group if self.tp_workers is not None else TPGroup()
        try:
            with building(group):
                self.model = load_model(self.source, self.device, self.dtype, seed=config.seed,
                                        progress=config.show_progress,
                                        quantization=config.quantization)
                self.runner = ModelRunner(self.model, config, self.device, self.dtype,
                                          self.max_model_len)
        except BaseException:
            self.shutdown()  # the other ranks stop now, not when this object is collected
            raise
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = self._eos_ids()
        self.checks = RequestChecks(self.source.name, self.vocab_size, self.max_model_len,
                                    self.tokenizer is not None)
        if self.tp_workers is not None:
            self.tp_workers.build(self.runner.num_blocks)
            self.runner.workers = self.tp_workers
        if self.device.type == "cuda":
            if self.tp_workers is not None:
                self.tp_workers.warm_up()
            self.runner.warm_up(progress=config.show_progress)
            if self.tp_workers is not None:
                self.tp_workers.warmed()
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len)
        self.sampler = Sampler(self.device, config.seed)
        self._running_step: LaunchedStep | None = None  # launched, not yet resolved
        self.stats = EngineStats()
        # (seconds, sequences) of recent steps, drained by a metrics reader (bounded: unread
        # samples are dropped, never piled up).
        self.step_samples: deque[tuple[float, int]] = deque(maxlen=4096)
        self.startup_s = time.perf_counter() - t0
        log.info("engine ready in %.1fs (%s, %s, weights %s, KV cache %s, attention %s, "
                 "warm-up %.1fs)", self.startup_s, self.device, str(self.dtype)[6:],
                 self.weights_name, str(self.runner.kv_dtype)[6:], self.runner.backend.name,
                 self.runner.warm_up_s)

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache and its layout, for a transfer endpoint (``kvtransfer.endpoint_for``).
        With tensor parallelism every rank's cache is in it (the other ranks share theirs with
        this process the first time this is asked)."""
        cfg = self.source.config
        workers = [] if self.tp_workers is None else self.tp_workers.kv_caches()
        ranks = (self.runner.kv_cache, *(cache for cache, _ in workers)) if workers else ()
        handles = (None, *(handle for _, handle in workers)) if workers else ()
        return KVCacheSpec(kv_cache=self.runner.kv_cache, model=self.source.model_id,
                           dtype=str(self.runner.kv_dtype).removeprefix("torch."),
                           num_layers=cfg.num_hidden_layers,
                           num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                           block_size=self.config.block_size, rank_caches=ranks,
                           rank_handles=handles)

    @property
    def weights_name(self) -> str:
        """What the linear layers hold: ``fp8 (<source>, <format>)`` or the compute dtype."""
        scheme = self.model.quantization
        return scheme.name if scheme is not None else str(self.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        return self.source.config.vocab_size

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.source.config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_cfg = self.source.path / "generation_config.json" if self.source.path else None
        if gen_cfg is not None and gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            self.checks.text()
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        self.validate_prompt(ids)
        return ids

    def validate_prompt(self, ids: list[int]) -> None:
        self.checks.prompt(ids)
        blocks = -(-(len(ids) + 1) // self.config.block_size)
        if blocks > self.pool.num_usable_blocks:
            raise BadRequest(f"prompt: {len(ids)} tokens need {blocks} KV blocks; the cache has "
                             f"{self.pool.num_usable_blocks}")

    def validate_params(self, params: SamplingParams) -> None:
        """The shared checks (:mod:`engine.validation`), and a structured output compiles for
        the tokenizer (cached by spec)."""
        self.checks.params(params)
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)  # a bad spec: BadRequest

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The model's structured-output compiler (made at the first request that needs it)."""
        if self.tokenizer is None:
            raise BadRequest(f"structured output: model {self.source.name!r} has no tokenizer")
        return Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)

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
        params = params or SamplingParams()
        if params.num_sequences > 1:
            raise BadRequest(f"n/best_of: an engine request is one sequence, got "
                             f"{params.num_sequences}; fan it out (engine.sampling_params.fan_out)")
        self.validate_params(params)
        ids = self.tokenize(prompt)
        if request_id is not None and self.scheduler.find(request_id) is not None:
            raise BadRequest(f"request_id: {request_id!r} is already in use")
        seq = Sequence(request_id or uuid.uuid4().hex, ids, params)
        self.stats.prompt_tokens += len(ids)
        if params.seed is not None:
            seq.generator = self.sampler.new_generator()
        if params.structured_output is not None:
            resumed = ids[len(ids) - params.num_resumed_tokens:] if params.num_resumed_tokens else ()
            seq.matcher = self.grammars.matcher(params.structured_output, resumed)
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
            return None
        skip = seq.num_present_tokens // self.config.block_size
        return seq.request_id, seq.block_ids[skip:], seq.num_present_tokens

    def admit(self, request_id: str, first_token: int, first_logprob: float | None = None,
              first_top: TopLogprobs | None = None) -> RequestOutput:
        """The pushed KV has landed and the prefill engine sampled ``first_token`` (with its
        logprob and top logprobs where asked): join the running batch (or finish at once if
        that token ends the request)."""
        seq = self.scheduler.transferring.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} has no reserved blocks")
        if not 0 <= first_token < self.vocab_size:
            raise BadRequest(f"first_token: {first_token} is outside the vocabulary")
        self.scheduler.admit_transferred(seq)
        self._append_token(seq, first_token, first_logprob)
        asked = seq.params.logprobs is not None
        return self._output(seq, [first_token], [first_logprob] if asked else None,
                            [first_top or []] if asked and seq.params.logprobs else None)

    def _fence_released_blocks(self) -> None:
        """Blocks given back since the running step was launched may still be written by it (a
        sequence that stopped while it was in flight). Before another engine is let write into
        blocks from the pool, wait for that step, so its late writes cannot land on theirs."""
        step = self._running_step
        if step is not None and self.scheduler.num_releases != step.releases:
            step.wait()
            step.releases = self.scheduler.num_releases

    def check_ranks(self) -> None:
        """Raise if a rank of a tensor-parallel engine is gone."""
        if self.tp_workers is not None and (dead := self.tp_workers.dead()):
            raise RuntimeError(f"tensor-parallel rank(s) {dead} died")

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do otherwise)."""
        if self.tp_workers is not None:
            self.tp_workers.close()
            self.tp_workers = None

    def reset_prefix_cache(self) -> int:
        """Make every cached block that no request holds a miss again (vLLM's
        ``reset_prefix_cache``): benchmarks that replay prompts start each point cold."""
        return self.pool.reset_prefix_cache()

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._running_step is not None

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        outputs = [self._output(s, [], None) for s in batch.finished]
        launched = self._launch(batch) if batch else None
        due = [self._running_step] if self._running_step is not None else []
        self._running_step = None
        if self.config.async_scheduling:
            self._running_step = launched
        elif launched is not None:
            due.append(launched)
        for step in due:
            outputs += self._resolve(step)
        stats = self.stats
        elapsed = time.perf_counter() - t0
        stats.steps += 1
        stats.step_seconds += elapsed
        self.step_samples.append((elapsed, len(batch.seqs)))
        stats.scheduled_tokens += batch.num_tokens
        stats.output_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the batch, its sampling and the copy of the sampled ids; nothing waits."""
        running = self._running_step
        logits = self.runner.execute(batch, running.tokens if running is not None else None)
        due = self.scheduler.advance(batch)
        step = LaunchedStep(due)
        if (p := self.runner.prompt_out) is not None:
            p.logprobs, p.top_ids, p.top_logprobs = (self._to_host(t) for t in (
                p.logprobs, p.top_ids, p.top_logprobs))
            step.prompt = p
        if due:
            out = self.sampler(logits, due, running.tokens if running is not None else None,
                               self.eos_token_ids,
                               self.grammars if any(s.matcher for s in due) else None)
            step.tokens = out.tokens
            if self.tp_workers is not None:  # the workers' copy of what the next step reads
                broadcast(out.tokens.to(torch.int64), self.tp_workers.group)
            step.host_tokens, step.host_logprobs = self._to_host(out.tokens), \
                self._to_host(out.logprobs)
            step.host_top_ids, step.host_top_logprobs = self._to_host(out.top_ids), \
                self._to_host(out.top_logprobs)
            for row, seq in enumerate(due):
                seq.add_pending(row)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        step.releases = self.scheduler.num_releases
        return step

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.device.type != "cuda":
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def _resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step and turn its sampled ids into tokens and outputs."""
        if step.prompt is None and not step.due:
            return []
        step.wait()
        if step.prompt is not None:
            self._store_prompt_logprobs(step.prompt)
        if not step.due:
            return []
        tokens = step.host_tokens.tolist()
        logprobs = step.host_logprobs.tolist() if step.host_logprobs is not None else None
        top_ids = step.host_top_ids.tolist() if step.host_top_ids is not None else None
        top_lps = step.host_top_logprobs.tolist() if step.host_top_ids is not None else None
        outputs = []
        for i, (seq, token) in enumerate(zip(step.due, tokens)):
            if seq.is_finished:  # stopped (or aborted) while this step ran: drop its token
                continue
            seq.resolve_pending(token)
            self.kv_manager.commit(seq)
            self._check_stop(seq, token)
            self._advance_grammar(seq, token)
            k = seq.params.logprobs
            outputs.append(self._output(
                seq, [token], [logprobs[i]] if k is not None else None,
                [list(zip(top_ids[i][:k], top_lps[i][:k]))] if k else None))
        return outputs

    @staticmethod
    def _store_prompt_logprobs(p) -> None:
        lps = p.logprobs.tolist()
        ids = p.top_ids.tolist() if p.top_ids is not None else None
        vals = p.top_logprobs.tolist() if p.top_logprobs is not None else None
        for i, (seq, pos) in enumerate(p.owners):
            k = seq.params.prompt_logprobs
            seq.prompt_logprobs[pos] = [lps[i], [[t, v] for t, v in zip(ids[i][:k], vals[i][:k])]
                                        if k else []]

    def _append_token(self, seq: Sequence, token: int, logprob: float | None) -> None:
        seq.token_ids.append(token)
        self._check_stop(seq, token)
        self._advance_grammar(seq, token)

    def _advance_grammar(self, seq: Sequence, token: int) -> None:
        """A structured-output sequence's matcher takes its new token; a complete grammar (its
        end-of-sequence token taken) ends the sequence with ``stop``."""
        m = seq.matcher
        if m is None or m.is_terminated():
            return
        if not m.accept_token(token):  # the mask allowed it: only a token from elsewhere
            log.error("request %s: token %d breaks its grammar; stopping it", seq.request_id,
                      token)
        elif not m.is_terminated():
            return
        if not seq.is_finished:
            seq.stop_reason = token
            self.scheduler.finish(seq, FinishReason.STOP)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reason = None
        if not p.ignore_eos and token in self.eos_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, token
        elif token in p.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, token
        elif (seq.num_output_tokens - seq.num_pending >= p.max_tokens
              or seq.num_resolved_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, seq: Sequence, new_tokens: list[int], new_logprobs: list[float] | None,
                new_top: list[TopLogprobs] | None = None) -> RequestOutput:
        prompt = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent and new_tokens:
            prompt, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return RequestOutput(
            seq.request_id, new_tokens, new_logprobs, seq.is_finished,
            seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
            seq.num_resolved_tokens - seq.num_prompt_tokens, seq.num_cached_tokens, new_top,
            prompt)
