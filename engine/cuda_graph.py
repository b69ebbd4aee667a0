"""CUDA graphs of the decode step, one per batch size in a fixed set.

Each graph covers embedding → all layers → final norm → logits for ``size`` sequences of one
query token each, reading its inputs from static buffers (token ids, positions, slot mapping)
and writing float32 logits into a static buffer. A step of ``n`` sequences replays the smallest
graph with ``size >= n``: rows past ``n`` are padding (token 0 at position 0, slot -1 so nothing
is stored, one page of the null block). Graphs are captured largest first into one shared
memory pool. Attention uses one decode wrapper with fixed index buffers per size (Baton's
few-row kernel up to its rows, FlashInfer's above), re-planned on the host before each replay;
a size whose long steps run FlashInfer's kernel instead (``backend.long_context``) has a second
graph, captured with that wrapper and replayed for them.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from engine.forward_context import AttentionMetadata, null_meta, set_forward_context


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.backend = runner.backend
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        dev, vocab = runner.device, runner.model.config.vocab_size
        # ids, positions, slots (read by the graphs), and the pending-token rows (see
        # :class:`engine.model_runner.StepInputs`)
        self.inputs = torch.zeros(4, self.max_batch, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(self.max_batch, vocab, dtype=torch.float32, device=dev)
        # The block table of a full batch: sequences that share prefix blocks each list them,
        # so it can exceed the cache's own block count (256 sequences of one 4k-token prompt
        # list 65k blocks). One buffer serves every size: a step's plan is copied in on the
        # stream after the previous step's graph.
        per_seq = -(-runner.max_model_len // runner.block_size)
        pages = torch.zeros(self.max_batch * per_seq + self.max_batch, dtype=torch.int32,
                            device=dev)
        self.wrappers = {s: self.backend.graph_decode_wrapper(s, pages) for s in self.sizes}
        # A second graph of the sizes whose long steps take another attention kernel
        # (``backend.long_context``).
        self.long_wrappers = {s: w for s in self.sizes if (
            w := self.backend.graph_decode_wrapper(s, pages, long_context=True)) is not None}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.long_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        t0 = time.perf_counter()
        pool = None
        model = self.runner.model
        variants = [(size, long) for size in sorted(self.sizes, reverse=True)
                    for long in ((False, True) if size in self.long_wrappers else (False,))]
        for size, long in tqdm(variants, desc="capturing decode graphs", disable=not progress,
                               leave=False):
            meta = null_meta(size, 1, self.runner.block_size)
            self.backend.plan_decode((self.long_wrappers if long else self.wrappers)[size], meta)
            ids, pos, slots = self.inputs[0, :size], self.inputs[1, :size], self.inputs[2, :size]
            slots.fill_(-1)
            meta.slot_mapping = slots
            with set_forward_context(meta):
                model(ids, pos)  # eager once: compiles kernels, settles allocations
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[:size].copy_(model.compute_logits(model(ids, pos)))
            pool = graph.pool()
            (self.long_graphs if long else self.graphs)[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """Wait for the replays queued and free the graphs. A split engine does this before its
        NCCL group ends: a communicator whose work a live graph holds does not end (NCCL's
        shutdown waits for that work, pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.inputs.device)
        for graph in (*self.graphs.values(), *self.long_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.long_graphs.clear()

    def run(self, step, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Queue a replay for the ``n`` sequences of ``step`` (:class:`StepInputs`); returns
        float32 logits ``[n, vocab]`` (valid once the replay has run). A fresh pinned buffer per
        call: the previous step's copy may still be queued behind the running step."""
        n = len(step.ids)
        size = self.size_for(n)
        self.inputs[:, :size].copy_(step.host_rows(size).pin_memory(), non_blocking=True)
        step.feed_pending(self.inputs[0], self.inputs[3], prev_tokens)
        long = size in self.long_graphs and self.backend.long_context(step.meta)
        wrappers, graphs = ((self.long_wrappers, self.long_graphs) if long
                            else (self.wrappers, self.graphs))
        self.backend.plan_decode(wrappers[size], self._padded_meta(step.meta, size))
        graphs[size].replay()
        return self.logits[:n]

    @staticmethod
    def _padded_meta(meta: AttentionMetadata, size: int) -> AttentionMetadata:
        """``meta`` followed by padding rows of the null block, ``size`` rows in all."""
        pad = size - meta.num_seqs
        if pad == 0:
            return meta
        null = null_meta(pad, 1, meta.block_size)
        return AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            query_start_loc=list(range(size + 1)),
            context_lens=meta.context_lens + null.context_lens,
            kv_indptr=torch.cat([meta.kv_indptr, null.kv_indptr[1:] + meta.kv_indptr[-1]]),
            kv_indices=torch.cat([meta.kv_indices, null.kv_indices]),
            kv_last_page_len=torch.cat([meta.kv_last_page_len, null.kv_last_page_len]),
            block_size=meta.block_size, is_decode_only=True)


def graph_max_tokens(configured: int | None, fp8_weights: bool) -> int:
    """The largest step the piecewise graphs take (``cuda_graph_max_tokens``; None: the default).

    Measured on an H100 (8B, one prompt a step, docs/benchmarks.md): with bf16 weights a step
    of 1-2k tokens is bound by its GEMMs, and graphs saved 0.8-1.1 ms of 26-52 (3%) where the
    prompt filled a size exactly but lost 1.1 ms at 1,100 tokens (padded to 1,152); with FP8
    weights the eager step is bound by the host (each projection's activation quantization and
    scaled GEMM cost it ~133 us to launch), and graphs took a 1,024-token step from 31.4 to
    18.8 ms and 1,100 tokens from 35.1 to 22.6. Hence 2,048 for FP8 weights, 512 otherwise."""
    if configured is not None:
        return configured
    return 2048 if fp8_weights else 512


def mixed_sizes(max_tokens: int) -> list[int]:
    """Token counts a piecewise graph is captured for: every 16 to 128, every 32 to 256, every
    64 to 512, every 128 beyond (a step pads to the next one: at most 25% more rows, and at most
    12.5% from 1,024 tokens on, where the step's compute, not its launches, sets its time)."""
    sizes = [s for s in range(16, 129, 16)] + list(range(160, 257, 32)) + \
        list(range(320, 513, 64))
    sizes = [s for s in sizes if s <= max_tokens] + list(range(640, max_tokens + 1, 128))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class MixedGraphs:
    """Piecewise CUDA graphs for the steps a decode graph cannot take: prefill chunks and steps
    that mix prompt tokens with decoding sequences, of up to ``max_tokens`` tokens.

    An eager step of Qwen3-8B launches ~20 kernels a layer from Python, and every running
    sequence's next token waits for it: on an H200 a 128-token prompt beside 64 decoding
    sequences took 15.3 ms a step eagerly and 10.6 ms with these graphs (the decode step
    alone 6.2 ms; docs/benchmarks.md). Here everything but attention is captured, per token
    count in :func:`mixed_sizes`: piece 0 is the embedding and layer 0 up to its queries (the
    K/V stored), piece ``i`` is layer ``i-1`` after attention and layer ``i`` up to its queries,
    and the last piece is the last layer after attention and the final norm. Attention runs
    eagerly between the pieces, with the step's own FlashInfer plan (its shape differs every
    step: vLLM's piecewise graphs split there for the same reason). A step of ``n`` tokens pads
    to the next size: the padding rows are token 0 at position 0 with slot -1 (nothing stored);
    attention runs on the ``n`` real rows only, and every other operation is row-wise, so the
    padding never touches a real row.

    Without ``capture`` (CPU, tests) the pieces run as plain calls over the same buffers.
    """

    def __init__(self, runner, max_tokens: int, capture: bool = True):
        self.runner = runner
        self.model = runner.model.model  # Qwen3Model: embed_tokens, layers, norm
        self.sizes = mixed_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.use_graphs = capture
        cfg, dev = runner.model.config, runner.device
        attn = self.model.layers[0].self_attn
        m = self.max_tokens
        # ids, positions, slots (read by the pieces), the pending-token rows
        self.inputs = torch.zeros(4, m, dtype=torch.int64, device=dev)
        self.queries = torch.zeros(m, attn.num_heads, attn.head_dim, dtype=runner.dtype,
                                   device=dev)
        self.attn_out = torch.zeros_like(self.queries)
        self.residual = torch.zeros(m, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.hidden = torch.zeros(m, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_s = 0.0

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def _piece(self, size: int, i: int) -> None:
        """Piece ``i`` of a step of ``size`` rows, from and into the static buffers."""
        layers, pos = self.model.layers, self.inputs[1, :size]
        if i == 0:
            x, residual = self.model.embed_tokens(self.inputs[0, :size]), None
        else:
            x, residual = layers[i - 1].after_attention(self.attn_out[:size],
                                                        self.residual[:size])
        if i == len(layers):
            self.hidden[:size].copy_(self.model.norm(x, residual)[0])
            return
        layers[i].before_attention(pos, x, residual,
                                   out=(self.queries[:size], self.residual[:size]))

    def _meta_for_capture(self, size: int) -> AttentionMetadata:
        meta = null_meta(size, 1, self.runner.block_size)
        meta.slot_mapping = self.inputs[2, :size]
        return meta

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        t0 = time.perf_counter()
        pool = self.runner.graphs.graphs[max(self.runner.graphs.graphs)].pool() \
            if self.runner.graphs is not None and self.runner.graphs.graphs else None
        pieces = len(self.model.layers) + 1
        self.inputs[2].fill_(-1)
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing mixed-step graphs",
                         disable=not progress, leave=False):
            with set_forward_context(self._meta_for_capture(size)):
                for i in range(pieces):  # eager once: compiles kernels, settles allocations
                    self._piece(size, i)
                torch.cuda.synchronize()
                graphs = []
                for i in range(pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._piece(size, i)
                    pool = graph.pool()
                    graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """As :meth:`DecodeGraphs.release`."""
        torch.cuda.synchronize(self.inputs.device)
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()

    def run(self, step, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Queue the pieces and the eager attention of ``step`` (:class:`StepInputs`, of at most
        ``max_tokens`` tokens); returns the final hidden states of its ``n`` rows."""
        n = len(step.ids)
        size = self.size_for(n)
        rows = step.host_rows(size)
        self.inputs[:, :size].copy_(rows.pin_memory() if self.use_graphs else rows,
                                    non_blocking=True)
        step.feed_pending(self.inputs[0], self.inputs[3], prev_tokens)
        meta = step.meta
        meta.slot_mapping = self.inputs[2, :n]
        graphs = self.graphs.get(size) if self.use_graphs else None
        layers = self.model.layers
        with set_forward_context(meta):
            # Piece 0 (the embedding, layer 0 up to its queries) needs no attention plan: the
            # GPU runs it while the host plans.
            self._replay(graphs, size, 0)
            self.runner.backend.plan(meta)
            for i, layer in enumerate(layers):
                if i:
                    self._replay(graphs, size, i)
                layer.self_attn.attend(self.queries[:n], out=self.attn_out[:n])
            self._replay(graphs, size, len(layers))
        return self.hidden[:n]

    def _replay(self, graphs, size: int, i: int) -> None:
        if graphs is None:
            with set_forward_context(self._meta_for_capture(size)):
                self._piece(size, i)
        else:
            graphs[i].replay()
