"""Model runner: owns the model, the paged KV cache and the attention backend.

One call of :meth:`ModelRunner.execute` is prepare inputs → forward context → forward → logits
of the sequences due a token. Decode-only steps replay a captured CUDA graph when there is one;
other steps of up to ``cuda_graph_max_tokens`` tokens (prefill chunks, prompts joining a decode
batch) replay piecewise graphs with attention run eagerly between them (:mod:`engine.cuda_graph`),
but a lone prompt with nothing cached before it, which replays one graph of its whole step;
larger steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.attention import get_backend
from engine.config import EngineConfig
from engine.cuda_graph import (DecodeGraphs, MixedGraphs, graph_max_tokens, graphs_draw,
                               prompt_graph_max_tokens)
from engine.forward_context import AttentionMetadata, null_meta, set_forward_context
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.sampler import Draw
from engine.scheduler import ScheduledBatch
from engine.uploads import host_tensor, upload
from kernels._triton import triton as _triton
from kernels.fp8 import FP8, fp8_gemv_config, fp8_supported
from kernels.gemv import NORM_FUSE_MAX_K, config_for

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_GB = 0.25
# A step taken as one attention row a token (ModelRunner._as_rows) reads a sequence's cache once
# a row, not once: at most this many tokens of cache read again (~0.7 ms of an H100's
# bandwidth for Qwen3-8B's KV, about what the decode graph saves at batch 1).
ROWS_MAX_EXTRA_KV = 16384


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """``kv_cache_dtype`` → the cache's element type: ``auto`` is the compute dtype."""
    return dtype if name == "auto" else FP8


def block_bytes(model_config, num_kv_heads: int, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one KV block of every layer of a rank holding ``num_kv_heads`` heads."""
    return (model_config.num_hidden_layers * 2 * num_kv_heads * block_size
            * model_config.head_dim * kv_dtype.itemsize)


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, extra_block_bytes: int = 0,
                 samples: bool = True):
        """``extra_block_bytes``: what another cache indexed by these blocks costs a block (a
        draft model's, engine.draft_model), counted when the blocks are sized from memory;
        ``samples``: the engine samples this runner's logits (not a draft's runner), so that
        its plain steps may take their tokens inside the decode graph (one rank, no
        speculation: :meth:`run`'s ``draws``)."""
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.extra_block_bytes = extra_block_bytes
        if config.fp8_lm_head:
            if not (fp8_supported(device) and dtype == torch.bfloat16):
                raise ValueError("fp8_lm_head: needs FP8 matmuls (CUDA, compute capability "
                                 f"8.9 or later, bf16); this engine runs {str(dtype)[6:]} on "
                                 f"{device}")
            model.quantize_lm_head()
        cfg = model.config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        attn = model.attention_layers()[0]  # this rank's heads (all of them on one rank)
        self.num_kv_heads = attn.num_kv_heads
        self.backend = get_backend(config.attention_backend, device, dtype,
                                   decode_tensor_cores=config.decode_tensor_cores,
                                   kv_dtype=self.kv_dtype,
                                   num_heads=attn.num_heads,
                                   num_kv_heads=self.num_kv_heads,
                                   head_dim=cfg.head_dim, scale=cfg.head_dim ** -0.5,
                                   block_size=self.block_size)
        self.num_blocks = self._num_blocks()
        # Memory is block-major, [blocks, layers, K/V, kv heads, block size, head dim], so one
        # block of every layer is one contiguous region (one descriptor per transfer run); the
        # engine and the transfer layer see it as [layers, blocks, ...] (``kv_cache``), where each
        # layer's slice is FlashInfer's HND paged layout with a page stride of all layers.
        self.kv_storage = torch.zeros(
            self.num_blocks, cfg.num_hidden_layers, 2, self.num_kv_heads, self.block_size,
            cfg.head_dim, dtype=self.kv_dtype, device=device)
        self.kv_cache = self.kv_storage.transpose(0, 1)
        for i, attn in enumerate(model.attention_layers()):
            attn.kv_cache = self.kv_cache[i]
            attn.backend = self.backend
        self.graphs = None
        self.mixed: MixedGraphs | None = None
        # Steps taken as one attention row a token (_as_rows): at most this many rows (0: never;
        # the largest decode graph where there are graphs), and on a draft's runner every step
        # that ends each sequence at its last token, not only those verifying proposals.
        self.rows_max = 0
        self.rows_for_all = False
        self.prompt_out: PromptLogprobs | None = None  # the last step's prompt logprobs
        # The last step's ids, where a graph took them (``run``'s ``draws``), on the device and,
        # where the graph wrote them there itself, in pinned host memory.
        self.sampled: torch.Tensor | None = None
        self.sampled_host: torch.Tensor | None = None
        self.others = None  # rank 0 of a tensor-parallel engine: engine.tp_ranks.RankProcesses
        if device.type == "cuda" and not config.enforce_eager \
                and self.backend.supports_cuda_graphs:
            spec = config.speculative_config  # (its verifications' rows get graphs too)
            self.graphs = DecodeGraphs(
                self, min(config.max_num_seqs, config.cuda_graph_max_batch),
                1 + spec.num_speculative_tokens if spec else 1,
                draws=samples and graphs_draw(config))
            self.rows_max = self.graphs.max_batch
            if max_tokens := graph_max_tokens(config.cuda_graph_max_tokens,
                                              model.quantization is not None):
                budget = config.max_num_batched_tokens
                prompt_max = prompt_graph_max_tokens(config.cuda_graph_prompt_max_tokens,
                                                     budget, max_model_len)
                self.mixed = MixedGraphs(self, min(max_tokens, budget),
                                         prompt_max_tokens=prompt_max)
        self.warm_up_s = 0.0
        self.gemv_choices: dict = {}  # projection name -> GemvConfig of its one-row kernel
        self.norm_fused: list[str] = []  # projections with the RMSNorm folded in (one row)

    # -- sizing -----------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return block_bytes(self.model.config, self.num_kv_heads, self.block_size, self.kv_dtype)

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_blocks is not None:
            return c.num_blocks
        if c.kv_cache_memory_gb is not None:
            budget = c.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_GB * 2**30
        # Never more than every sequence at full length needs (plus the null block).
        cap = c.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        per_block = self.block_bytes + self.extra_block_bytes
        num = min(int(budget // per_block), cap)
        if num < 2:
            raise ValueError(f"kv cache: the memory budget ({budget / 2**30:.2f} GiB) holds no "
                             f"block of {per_block} bytes")
        return num

    def _cuda_kv_budget(self) -> float:
        """This engine's share (``gpu_memory_utilization`` of the whole GPU) less what this
        process already holds (weights) and a step's activations; never more than is free, so
        engines that share a GPU each get their own share."""
        free, total = torch.cuda.mem_get_info(self.device)
        cfg = self.model.config
        tokens = self.config.max_num_batched_tokens
        # Activations of one step: the widest intermediates, plus float32 logits of every sequence.
        act = tokens * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * self.dtype.itemsize * 2
        act += self.config.max_num_seqs * cfg.vocab_size * 4 * 3
        share = total * self.config.gpu_memory_utilization - torch.cuda.memory_reserved(self.device)
        return min(share, free) - act

    # -- the host tier (engine.kv_offload) ---------------------------------------------------
    def allocate_host_tier(self, num_blocks: int) -> None:
        """``num_blocks`` blocks of host memory shaped like the device's (pinned on CUDA), one
        block of every layer one contiguous region, as on the device; on CUDA, the side stream
        the copies run on."""
        self.host_kv = torch.empty((num_blocks, *self.kv_storage.shape[1:]),
                                   dtype=self.kv_storage.dtype,
                                   pin_memory=self.device.type == "cuda")
        self.copy_stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                            else None)
        # copy id -> (start, end, bytes, out?) until landed; then counted in copy_totals:
        # bytes and seconds copied each way, "to_host" and "to_device", as the side stream
        # (or the CPU) spent them.
        self.copy_events: dict[int, tuple] = {}
        self.copy_totals = {"to_host": [0, 0.0], "to_device": [0, 0.0]}

    def copy_blocks(self, copies) -> None:
        """Queue a batch of the host tier's copies (``engine.kv_offload.KVCopies``): the step
        stream waits for the copies it names, then the copies out and in are queued on the
        side stream after every step launched so far, each timed and recorded under its id;
        nothing waits on the host. On the CPU they run now."""
        block = self.kv_storage[0].nbytes
        if self.copy_stream is None:
            for pairs, out in ((copies.to_host, True), (copies.to_device, False)):
                t0 = time.perf_counter()
                self._copy_runs(pairs, out)
                self._count_copy(out, len(pairs) * block, time.perf_counter() - t0)
            return
        main = torch.cuda.current_stream(self.device)
        for copy_id in copies.waits:
            if (timed := self.copy_events.get(copy_id)) is not None:
                main.wait_event(timed[1])
        self._landed()
        if copies.to_host or copies.to_device:
            self.copy_stream.wait_stream(main)
            with torch.cuda.stream(self.copy_stream):
                for copy_id, pairs, out in ((copies.out_id, copies.to_host, True),
                                            (copies.in_id, copies.to_device, False)):
                    if pairs:
                        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        start.record(self.copy_stream)
                        self._copy_runs(pairs, out)
                        end.record(self.copy_stream)
                        self.copy_events[copy_id] = (start, end, len(pairs) * block, out)
                        if copy_id in copies.waits:  # the next step overwrites blocks this
                            main.wait_event(end)  # batch's own copies read or write

    def _landed(self) -> None:
        """Count the copies that have landed and stop tracking them."""
        for copy_id, (start, end, nbytes, out) in list(self.copy_events.items()):
            if end.query():
                self._count_copy(out, nbytes, start.elapsed_time(end) / 1e3)
                del self.copy_events[copy_id]

    def _count_copy(self, out: bool, nbytes: int, seconds: float) -> None:
        totals = self.copy_totals["to_host" if out else "to_device"]
        totals[0] += nbytes
        totals[1] += seconds

    def _copy_runs(self, pairs: list[tuple[int, int]], out: bool) -> None:
        """Copy (device block, host block) pairs out, or (host block, device block) pairs in,
        a run of consecutive blocks on both sides as one copy."""
        start = 0
        for i in range(1, len(pairs) + 1):
            if i < len(pairs) and pairs[i][0] == pairs[i - 1][0] + 1 \
                    and pairs[i][1] == pairs[i - 1][1] + 1:
                continue
            (a, b), n = pairs[start], i - start
            if out:
                self.host_kv[b:b + n].copy_(self.kv_storage[a:a + n], non_blocking=True)
            else:
                self.kv_storage[b:b + n].copy_(self.host_kv[a:a + n], non_blocking=True)
            start = i

    def copies_done(self, copy_id: int) -> bool:
        """Whether copy ``copy_id`` has landed (one this runner no longer tracks has)."""
        timed = self.copy_events.get(copy_id)
        return timed is None or timed[1].query()

    def sync_copies(self) -> None:
        """Wait on the host until every queued copy has landed."""
        if getattr(self, "copy_stream", None) is not None:
            self.copy_stream.synchronize()
            self._landed()

    # -- start-up ---------------------------------------------------------------------------
    def warm_up(self, progress: bool = True) -> None:
        """Set the one-row projection kernels, compile every kernel variant (a full-budget
        prefill step, an eager decode step) and capture the decode graphs, so the first request
        pays for none of it."""
        t0 = time.perf_counter()
        self._choose_gemv()
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        self._forward(torch.zeros(tokens, dtype=torch.int64, device=self.device),
                      torch.arange(tokens, device=self.device),
                      self._on_device(null_meta(1, tokens, self.block_size)), [tokens - 1])
        self._forward(torch.zeros(1, dtype=torch.int64, device=self.device),
                      torch.zeros(1, dtype=torch.int64, device=self.device),
                      self._on_device(null_meta(1, 1, self.block_size)), [0])
        if self.graphs is not None:
            self.graphs.capture(progress)
        if self.mixed is not None:
            self.mixed.capture(progress)
        torch.cuda.synchronize(self.device)
        self.warm_up_s = time.perf_counter() - t0
        log.info("warm-up %.1fs (%d decode graphs in %.1fs, mixed-step graphs for %d token "
                 "counts and lone-prompt graphs for %d in %.1fs)", self.warm_up_s,
                 len(self.graphs.graphs) + len(self.graphs.long_graphs) if self.graphs else 0,
                 self.graphs.capture_s if self.graphs else 0.0,
                 len(self.mixed.graphs) if self.mixed else 0,
                 len(self.mixed.prompt_graphs) if self.mixed else 0,
                 self.mixed.capture_s if self.mixed else 0.0)

    def release_graphs(self) -> None:
        """Free the captured graphs (see :meth:`DecodeGraphs.release`)."""
        for graphs in (self.graphs, self.mixed):
            if graphs is not None:
                graphs.release()

    def _choose_gemv(self) -> None:
        """One-row steps (batch-1 decode) run every projection through the Triton skinny matmul
        with the config of its shape, and fold the RMSNorm into qkv and gate/up where that pays
        (:mod:`kernels.gemv`)."""
        self.gemv_choices, self.norm_fused = {}, []
        if not (self.config.triton_gemv and self.dtype in (torch.bfloat16, torch.float16)
                and self.device.type == "cuda" and _triton is not None):
            return
        for name, layers in self.model.projections().items():
            fp8 = layers[0].weight_scale is not None
            self.gemv_choices[name] = (fp8_gemv_config if fp8 else config_for)(
                *layers[0].weight.shape)
            for layer in layers:
                layer.gemv_config = self.gemv_choices[name]
        self.model.lm_head_gemv = config_for(*self.model.lm_head_weight.shape)
        self.gemv_choices["lm_head"] = self.model.lm_head_gemv
        for name, pairs in self.model.normed_projections().items():
            proj = pairs[0][1]
            if proj.weight_scale is None and proj.weight.shape[1] <= NORM_FUSE_MAX_K:
                self.norm_fused.append(name)
                for _, proj in pairs:
                    proj.fuse_norm = True
        log.info("one-row projections: %s; norm folded into %s",
                 {n: tuple(c) for n, c in self.gemv_choices.items()}, self.norm_fused or "none")

    def _on_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        n = meta.query_start_loc[-1]
        meta.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        return meta

    # -- one step ---------------------------------------------------------------------------
    def _as_rows(self, batch: ScheduledBatch) -> bool:
        """Whether the step's attention takes each token as a row of its own (one query over
        the sequence's cache up to and including its position: the causal mask made by the
        context lengths), so that it is a decode step and replays a decode graph: a step that
        verifies proposals (or, on a draft's runner, any step), every sequence's tokens ending
        at its last, while the rows fit the largest graph and the cache they read again stays
        small (``ROWS_MAX_EXTRA_KV``)."""
        if not self.rows_max or not (
                self.rows_for_all or any(s.draft_token_ids for s in batch.seqs)):
            return False
        rows = extra = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            end = seq.num_computed_tokens + n
            if end != seq.num_tokens + len(seq.draft_token_ids):
                return False
            rows += n
            extra += (n - 1) * end
        return len(batch.seqs) < rows <= self.rows_max and extra <= ROWS_MAX_EXTRA_KV

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Host-side inputs of one step (the device slot mapping is set when they are sent)."""
        bs = self.block_size
        ids, positions, slots, qsl, ctx, logit_rows = [], [], [], [0], [], []
        indptr, indices, last, gathers = [0], [], [], []
        prompt = PromptRows()
        as_rows = self._as_rows(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt.add(seq, len(ids), start, min(end, seq.num_prompt_tokens - 1))
            drafts = seq.draft_token_ids  # speculative decoding: proposals after its last token
            ids += (seq.token_ids + drafts)[start:end] if drafts else seq.token_ids[start:end]
            if end > seq.num_resolved_tokens and not drafts:
                # its input is the token the running step samples
                ids[-1] = 0
                gathers.append((len(ids) - 1, seq.pending_row))
            elif drafts and seq.draft_rows is not None:  # the draft's, still on the device
                first = len(ids) - len(drafts)
                gathers += [(first + j, r) for j, r in enumerate(seq.draft_rows)]
            positions += range(start, end)
            table, p = seq.block_ids, start
            if p < seq.num_present_tokens:  # already in the cache (loaded): not stored again
                p = min(seq.num_present_tokens, end)
                slots += [-1] * (p - start)
            while p < end:  # a block's run of slots at a time (a prompt's thousands)
                b, off = divmod(p, bs)
                run = min(end - p, bs - off)
                first = table[b] * bs + off
                slots += range(first, first + run)
                p += run
            for row_end in (range(start + 1, end + 1) if as_rows else (end,)):
                qsl.append(len(ids) - (end - row_end))
                ctx.append(row_end)
                pages = -(-row_end // bs)
                indices += table[:pages]
                indptr.append(len(indices))
                last.append(row_end - (pages - 1) * bs)
            if end == seq.num_tokens + len(drafts):  # its last token's row, then each proposal's
                logit_rows += range(len(ids) - 1 - len(drafts), len(ids))
        meta = AttentionMetadata(
            slot_mapping=None, query_start_loc=qsl, context_lens=ctx,
            kv_indptr=host_tensor(indptr, torch.int32),
            kv_indices=host_tensor(indices, torch.int32),
            kv_last_page_len=host_tensor(last, torch.int32),
            block_size=bs,
            is_decode_only=as_rows or all(n == 1 for n in batch.num_new_tokens))
        return StepInputs(ids, positions, slots, gathers, meta, logit_rows, prompt)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None,
                draws: list[Draw] | None = None) -> torch.Tensor | None:
        """Queue the batch on the device; return float32 logits of the sequences due a token
        (or None). ``prev_tokens``: the sampled tokens of the step still running, which pending
        inputs are read from. ``draws``: each sequence's token is drawn from its raw logits
        alone, a :class:`~engine.sampler.Draw` a sequence
        (:meth:`engine.cuda_graph.DecodeGraphs.run`); a decode graph may then take it, and
        ``sampled`` holds the ids (else None), and ``sampled_host`` their host copy where the
        graph wrote one (valid once the step has run, until the step after next). Nothing here
        waits for the device."""
        step = self.prepare(batch)
        if self.others is not None:
            self.others.step(step)
        return self.run(step, prev_tokens, draws)

    @torch.inference_mode()
    def run(self, step: StepInputs, prev_tokens: torch.Tensor | None = None,
            draws: list[Draw] | None = None) -> torch.Tensor | None:
        """Run prepared inputs (every rank of a tensor-parallel engine runs the same ones)."""
        self.prompt_out = self.sampled = self.sampled_host = None
        if step.gathers and prev_tokens is None:
            raise RuntimeError("a pending token is an input but no step is running")
        if (self.graphs is not None and step.meta.is_decode_only and not step.prompt.rows
                and step.meta.num_seqs <= self.graphs.max_batch):
            logits = self.graphs.run(step, prev_tokens, draws if draws is not None
                                     and len(step.logit_rows) == len(step.ids) else None)
            self.sampled, self.sampled_host = self.graphs.sampled, self.graphs.sampled_host
        elif self.mixed is not None and (len(step.ids) <= self.mixed.max_tokens
                                         or self.mixed.prompt_size(step)):
            return self._logits(self.mixed.run(step, prev_tokens), step.logit_rows, step.prompt)
        else:
            dev = upload(step.host_rows(), torch.int64, self.device)
            step.meta.slot_mapping = dev[2]
            step.feed_pending(dev[0], dev[3], prev_tokens)
            return self._forward(dev[0], dev[1], step.meta, step.logit_rows, step.prompt)
        if len(step.logit_rows) == len(step.ids):
            return logits
        return logits[upload(step.logit_rows, torch.int64, self.device)]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logit_rows: list[int], prompt: PromptRows | None = None) -> torch.Tensor | None:
        with set_forward_context(meta):  # planned while layer 0 runs up to its attention
            hidden = self.model(input_ids, positions, plan=lambda: self.backend.plan(meta))
        return self._logits(hidden, logit_rows, prompt)

    def _logits(self, hidden: torch.Tensor, logit_rows: list[int],
                prompt: PromptRows | None = None) -> torch.Tensor | None:
        """Prompt logprobs (kept in ``prompt_out``) and the logits of ``logit_rows``."""
        if prompt is not None and prompt.rows:
            self.prompt_out = self._prompt_logprobs(hidden, prompt)
        if not logit_rows:
            return None
        if len(logit_rows) < hidden.shape[0]:
            hidden = hidden[upload(logit_rows, torch.int64, self.device)]
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt: PromptRows) -> PromptLogprobs:
        """Log-softmax of the raw logits at the prompt rows (as sampled tokens' logprobs are),
        in slices of rows so that a long prompt never holds its whole [rows, vocab] at once."""
        rows = upload(prompt.rows, torch.int64, self.device)
        targets = upload(prompt.targets, torch.int64, self.device)
        lps, ids, vals = [], [], []
        for i in range(0, len(prompt.rows), PROMPT_LOGPROB_ROWS):
            sl = slice(i, i + PROMPT_LOGPROB_ROWS)
            logp = torch.log_softmax(self.model.compute_logits(hidden[rows[sl]]).float(), -1)
            lps.append(logp.gather(1, targets[sl, None]).squeeze(1))
            if prompt.k:
                v, ix = logp.topk(prompt.k, -1)
                vals.append(v)
                ids.append(ix)
        return PromptLogprobs(prompt.owners, torch.cat(lps), torch.cat(ids) if ids else None,
                              torch.cat(vals) if vals else None)


PROMPT_LOGPROB_ROWS = 512  # rows of full-vocabulary logits made at once (float32)


@dataclass
class PromptRows:
    """Rows of a step whose logits score the next prompt token (``prompt_logprobs``):
    ``owners[i]`` is (sequence, position of the scored token)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    owners: list[tuple] = field(default_factory=list)
    k: int = 0

    def add(self, seq, row0: int, start: int, stop: int) -> None:
        """Positions ``start..stop-1`` of ``seq`` (rows from ``row0``) score tokens 1 later."""
        for pos in range(start, stop):
            self.rows.append(row0 + pos - start)
            self.targets.append(seq.token_ids[pos + 1])
            self.owners.append((seq, pos + 1))
        self.k = max(self.k, seq.params.prompt_logprobs)


@dataclass
class PromptLogprobs:
    """Device results of :class:`PromptRows`: each row's target logprob and its top ``k``."""

    owners: list[tuple]
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@dataclass
class StepInputs:
    """One step's inputs on the host. ``gathers``: ``(row, pending row)`` pairs, rows whose token
    id is the ``pending row``-th token sampled by the step still running (on the device)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    gathers: list[tuple[int, int]]
    meta: AttentionMetadata
    logit_rows: list[int]
    prompt: PromptRows = field(default_factory=PromptRows)

    def host_rows(self, size: int | None = None) -> torch.Tensor:
        """``[4, size]`` int64: ids, positions, slots, and the pending row to read each id from
        (-1: none); rows past ``len(ids)`` are padding (token 0 at position 0, slot -1)."""
        n = len(self.ids)
        size = n if size is None else size
        pad = size - n
        src = [-1] * n
        for row, pending in self.gathers:
            src[row] = pending
        return host_tensor(self.ids + [0] * pad + self.positions + [0] * pad + self.slots
                           + [-1] * pad + src + [-1] * pad, torch.int64).view(4, size)

    def feed_pending(self, ids: torch.Tensor, src: torch.Tensor,
                     prev_tokens: torch.Tensor | None) -> None:
        """Overwrite the pending rows of the device ``ids`` with the running step's tokens."""
        if not self.gathers:
            return
        n = len(self.ids)
        if len(self.gathers) == n:  # the usual decode step: every input is pending
            torch.index_select(prev_tokens, 0, src[:n], out=ids[:n])
        else:
            ids[:n] = torch.where(src[:n] >= 0, prev_tokens[src[:n].clamp(min=0)], ids[:n])
