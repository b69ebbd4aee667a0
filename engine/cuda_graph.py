"""CUDA graphs of the decode step, one per batch size in a fixed set.

Each graph covers embedding → all layers → final norm → logits for ``size`` sequences of one
query token each, reading its inputs from static buffers (token ids, positions, slot mapping)
and writing float32 logits into a static buffer. A step of ``n`` sequences replays the smallest
graph with ``size >= n``: rows past ``n`` are padding (token 0 at position 0, slot -1 so nothing
is stored, one page of the null block). Graphs are captured largest first into one shared
memory pool. Attention uses one decode wrapper with fixed index buffers per size (Baton's
kernel, or FlashInfer's where ``BATON_SMALL_DECODE`` says so), re-planned on the host before
each replay (Baton's kernel's page table copied in with the step's inputs,
:class:`StagedInputs`); a size whose long steps run FlashInfer's kernel instead
(``backend.long_context``: up to 8 rows) has a second graph, captured with that wrapper and
replayed for them.

A size of at most ``ARGMAX_MAX_ROWS`` rows has more graphs ("draw graphs"), for a step whose
every row's token is drawn from its raw logits alone, greedy or at a temperature, cut or not
to a top-k and top-p (:meth:`DecodeGraphs.run`'s ``draws``): they also take their pending input
ids from the graphs' own buffer of sampled ids at their head (:mod:`kernels.pending_ids`) and
write the rows' tokens (the argmax, or the row's draw: :mod:`kernels.argmax`) into that buffer
at their end, so that neither runs as a launch of its own around the replay. On Baton's
decode kernel (not a long step) there are two, one for each of :class:`StagedInputs`' pinned
buffers: the graph's first kernel reads the step's inputs from that buffer itself and its
argmax writes the ids into a pinned buffer of the same turn, so that no copy is queued before
or after the replay.
"""

from __future__ import annotations

import os
import time

import torch
from tqdm import tqdm

from engine.forward_context import AttentionMetadata, null_meta, set_forward_context
from engine.sampler import GREEDY_DRAW, Draw, pack_draws
from kernels.argmax import RowArgmax
from kernels.decode_attention import MAX_ROWS, DecodeAttention
from kernels.pending_ids import take_inputs, take_pending

# Sizes up to which a plain step's graph holds its pending-id gather and its argmax or draw (0:
# none; ``BATON_GREEDY_GRAPH_ROWS=0`` samples every step apart, for A/B measurements of served
# apps).
ARGMAX_MAX_ROWS = int(os.environ.get("BATON_GREEDY_GRAPH_ROWS", "8"))
# Whether those on Baton's decode kernel read their inputs from pinned memory and write their ids
# there themselves (False: the copies queued around the replay; kept for A/B measurements).
GREEDY_READS_HOST = True


def graphs_draw(config) -> bool:
    """Whether an engine of ``config`` (:class:`~engine.config.EngineConfig`) captures draw
    graphs, which take a plain step's tokens themselves: one rank and no speculation (a
    verification's rows and the other ranks' logits need the sampler)."""
    return config.speculative_config is None and config.tensor_parallel_size == 1


def capture_sizes(max_batch: int, step_rows: int = 1) -> list[int]:
    """1, 2, 4, then every 8 up to ``max_batch``. With speculation (``step_rows``: 1 + the
    proposals a sequence verifies), also the rows of 1, 2 and 4 sequences verifying a full set,
    as vLLM sizes its graphs in multiples of 1 + k: one sequence verifying 4 proposals replays
    a graph of 5 rows, not 8 (an H100, 8B FP8 and a 0.6B draft: a speculating step 0.7-2%
    shorter, docs/benchmarks.md)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    if step_rows > 1:
        sizes = sorted(set(sizes) | {step_rows * b for b in (1, 2, 4)
                                     if step_rows * b <= max_batch})
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, step_rows: int = 1, draws: bool = True):
        """``step_rows``: a speculating sequence's rows in a verification (capture_sizes);
        ``draws``: capture the plain steps' draw graphs (``ARGMAX_MAX_ROWS``)."""
        self.argmax_max_rows = ARGMAX_MAX_ROWS if draws else 0
        self.runner = runner
        self.backend = runner.backend
        self.sizes = capture_sizes(max_batch, step_rows)
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
        # The sizes on Baton's decode kernel take their inputs and its page table in one copy.
        few_row = [s for s, w in self.wrappers.items() if isinstance(w, DecodeAttention)]
        self.staged = StagedInputs(few_row, per_seq, dev) if few_row else None
        self.rows = {s: (self.staged.rows(s) if s in few_row else self.inputs[:, :s])
                     for s in self.sizes}  # each size's ids, positions, slots, pending rows
        for s in few_row:
            self.wrappers[s].bind(*self.staged.table(s))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.long_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # A plain step's draw graphs, keyed (size, long, turn): turn 0 or 1 where the graph reads
        # that pinned buffer of inputs itself and writes the ids into that turn's host buffer
        # (``host_tokens``), None where it takes the copies queued around it. The ids they
        # sample (``tokens``): the running step's when it replayed one, which the next such
        # replay reads and overwrites.
        self.draw_graphs: dict[tuple[int, bool, int | None], torch.cuda.CUDAGraph] = {}
        self.tokens = torch.zeros(self.max_batch, dtype=torch.int64, device=dev)
        self.host_tokens = [torch.zeros(self.argmax_max_rows, dtype=torch.int64,
                                        pin_memory=True) for _ in range(2)] \
            if self.staged is not None and self.argmax_max_rows else None
        self.argmax = RowArgmax()  # its own workspace, held for the graphs
        # The draw graphs' rows' :class:`Draw` fields, a row of ``argmax_max_rows`` each
        # (float32 inverse temperatures and top-p, int32 salts and top-k), as :meth:`run` last
        # sent them (written again only when they change).
        self.draw_params = torch.zeros(4 * self.argmax_max_rows, dtype=torch.int32, device=dev)
        self.draws_sent: list[Draw] = [GREEDY_DRAW] * self.argmax_max_rows
        # The last replay's ids, where it sampled them, on the device and, where a graph wrote
        # them there, on the host (valid once the replay has run, until the turn's next one).
        self.sampled: torch.Tensor | None = None
        self.sampled_host: torch.Tensor | None = None
        self.capture_s = 0.0

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        t0 = time.perf_counter()
        pool = None
        model = self.runner.model
        variants = [(size, long, draw, turn) for size in sorted(self.sizes, reverse=True)
                    for long in ((False, True) if size in self.long_wrappers else (False,))
                    for draw in ((False, True) if size <= self.argmax_max_rows else (False,))
                    for turn in ((0, 1) if draw and self._reads_host(size, long) else (None,))]
        self.argmax.reserve(self.max_batch, model.config.vocab_size, self.tokens.device,
                           cut=True)
        for size, long, draw, turn in tqdm(variants, desc="capturing decode graphs",
                                           disable=not progress, leave=False):
            meta = null_meta(size, 1, self.runner.block_size)
            self.backend.plan_decode((self.long_wrappers if long else self.wrappers)[size], meta)
            ids, pos, slots, src = self.rows[size]
            slots.fill_(-1)
            src.fill_(-1)
            meta.slot_mapping = slots
            if turn is not None:  # the null step's inputs, where the graph reads them
                self.staged.write(turn, self.rows[size].cpu(), meta)
            with set_forward_context(meta):
                # Eager once, the logits too: compiles kernels, loads them and settles
                # allocations (a kernel's first launch inside a capture can fail it: the FP8
                # head's few-row and W8A8 kernels over bf16 weights run nowhere before).
                self._step(size, draw, turn)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(size, draw, turn)
            pool = graph.pool()
            if draw:
                self.draw_graphs[(size, long, turn)] = graph
            else:
                (self.long_graphs if long else self.graphs)[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def _reads_host(self, size: int, long: bool) -> bool:
        """Whether the draw graphs of ``size`` (``long``) read their inputs from the pinned
        buffers themselves: those on Baton's decode kernel, whose table is staged with them."""
        return GREEDY_READS_HOST and not long and self.host_tokens is not None \
            and size in self.staged.words

    def _step(self, size: int, draw: bool, turn: int | None = None) -> None:
        """What a graph of ``size`` rows holds: the forward and the logits, and for a plain
        step the pending ids' gather before them and the argmax or draw after; with ``turn``,
        the step's inputs read from that pinned buffer first and the ids written to that
        turn's host buffer too."""
        model = self.runner.model
        ids, pos, _, src = self.rows[size]
        if turn is not None:
            take_inputs(self.staged.host[turn], self.staged.buffer, self.tokens, size)
        elif draw:
            take_pending(ids, src, self.tokens)
        model.compute_logits(model(ids, pos), out=self.logits[:size])
        if draw:
            fields = self.draw_params.view(4, self.argmax_max_rows)[:, :size]
            params = (fields[0].view(torch.float32), fields[1], pos, fields[2],
                      fields[3].view(torch.float32))
            self.argmax(self.logits[:size], out=self.tokens[:size],
                        host=None if turn is None else self.host_tokens[turn][:size],
                        draw=params)

    def release(self) -> None:
        """Wait for the replays queued and free the graphs. A split engine does this before its
        NCCL group ends: a communicator whose work a live graph holds does not end (NCCL's
        shutdown waits for that work, pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.inputs.device)
        for graph in (*self.graphs.values(), *self.long_graphs.values(),
                      *self.draw_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.long_graphs.clear()
        self.draw_graphs.clear()

    def run(self, step, prev_tokens: torch.Tensor | None = None,
            draws: list[Draw] | None = None) -> torch.Tensor:
        """Queue a replay for the ``n`` sequences of ``step`` (:class:`StepInputs`); returns
        float32 logits ``[n, vocab]`` (valid once the replay has run). Sizes on Baton's decode
        kernel send inputs and page table in one copy (:class:`StagedInputs`); the others a
        freshly pinned buffer of inputs (the previous step's copy may still be queued behind
        the running step) and FlashInfer's plan. ``draws``: every row is due a token drawn from
        its logits alone, a :class:`Draw` a row (:mod:`kernels.argmax`); where the size
        has a draw graph, ``sampled`` is then set to the ids it draws (``tokens[:n]``, valid
        until the next draw replay) and, where that graph wrote them to the host,
        ``sampled_host`` to those (else both to None). The rows' parameters are copied to the
        device only when they differ from the last sent (a batch's sequences come and go far
        less often than it steps)."""
        n = len(step.ids)
        size = self.size_for(n)
        long = size in self.long_graphs and self.backend.long_context(step.meta)
        wrappers, graphs = ((self.long_wrappers, self.long_graphs) if long
                            else (self.wrappers, self.graphs))
        reads_host = draws is not None and self._reads_host(size, long)
        key = (size, long, self.staged.turn if reads_host else None)
        draw_graph = self.draw_graphs.get(key) if draws is not None else None
        if draw_graph is not None and step.gathers and prev_tokens.data_ptr() != \
                self.tokens.data_ptr():  # the running step sampled elsewhere: its ids here
            if len(prev_tokens) > len(self.tokens):
                draw_graph = None
            else:
                self.tokens[:len(prev_tokens)].copy_(prev_tokens)
        if draw_graph is not None:
            self._send_draws(draws)
        reads_host = reads_host and draw_graph is not None
        meta = self._padded_meta(step.meta, size)
        rows = self.rows[size]
        staged = self.staged is not None and size in self.staged.words
        if staged:  # (a long step's table goes to FlashInfer's plan)
            turn = self.staged.stage(step.host_rows(size), None if long else meta,
                                     copy=not reads_host)
        else:
            rows.copy_(step.host_rows(size).pin_memory(), non_blocking=True)
        if draw_graph is None:
            step.feed_pending(rows[0], rows[3], prev_tokens)
        if staged and not long:
            meta.extras["wrapper"] = wrappers[size]  # (as plan_decode marks it)
        else:
            self.backend.plan_decode(wrappers[size], meta)
        (graphs[size] if draw_graph is None else draw_graph).replay()
        if reads_host:
            self.staged.copied[turn].record()  # (its pinned buffer is read by the replay)
        self.sampled = None if draw_graph is None else self.tokens[:n]
        self.sampled_host = self.host_tokens[turn][:n] if reads_host else None
        return self.logits[:n]

    def _send_draws(self, draws: list[Draw]) -> None:
        """Queue the copy of the rows' draw parameters where they changed since the last sent
        (rows past the step's keep theirs: padding, whose tokens nobody reads)."""
        if draws == self.draws_sent[:len(draws)]:
            return
        self.draws_sent[:len(draws)] = draws
        self.draw_params.copy_(pack_draws(self.draws_sent).view(-1).pin_memory(),
                               non_blocking=True)

    def written_size(self, rows: int, context_len: int) -> int | None:
        """The size whose graph takes a step of ``rows`` rows (the longest reading
        ``context_len`` tokens) with inputs written on the device into the staged buffer
        (:meth:`replay_written`): one on Baton's decode kernel of at most ``MAX_ROWS`` rows
        (the writer, ``kernels.ahead_inputs``, is one program over the rows, built for a few);
        None where there is none."""
        size = self.size_for(rows)
        if size is None or size > MAX_ROWS or self.staged is None or \
                size not in self.staged.words or (
                    size in self.long_graphs and self.backend.long_context_len(context_len)):
            return None
        return size

    def replay_written(self, size: int, rows: int) -> torch.Tensor:
        """Replay the graph of ``size`` rows over the inputs and page table a kernel has
        written into the staged buffer (``staged.buffer``, :class:`StagedInputs`' layout),
        queued before this call; returns the logits of the first ``rows``."""
        self.graphs[size].replay()
        return self.logits[:rows]

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


class StagedInputs:
    """The inputs of the decode graphs on Baton's decode attention, each size's in one device
    buffer: ``[ids | positions | slots | pending rows]`` (int64, ``size`` each), then
    the kernel's page table as int32 ``[indptr (size + 1) | last page lengths (size) |
    pages]``. A step's are written into pinned memory on the host and sent in one copy (four
    before: the rows from a freshly pinned tensor and the table's three parts from pageable
    memory). Every size's region starts at the buffer's start (a step's copy runs on the stream
    after the graph before it has); two pinned buffers take turns, each written again only
    once its last copy has run. A plain step's draw graph reads its turn's pinned buffer itself
    (:func:`kernels.pending_ids.take_inputs`) instead of the copy: :meth:`stage` without
    ``copy``, and ``copied`` recorded after that replay."""

    def __init__(self, sizes: list[int], pages_per_seq: int, device: torch.device):
        self.pages = {s: s * pages_per_seq + s for s in sizes}  # a padded batch's most pages
        self.words = {s: 4 * s + self._table_words(s, self.pages[s]) for s in sizes}
        n = max(self.words.values())
        self.buffer = torch.zeros(n, dtype=torch.int64, device=device)
        self.host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0

    def rows(self, size: int) -> torch.Tensor:
        """``[4, size]``: ids, positions, slots, pending rows (the graph's inputs)."""
        return self.buffer[:4 * size].view(4, size)

    def table(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Baton's decode kernel's indptr, last page lengths and pages for ``size`` rows."""
        return self._table(self.buffer, size, self.pages[size])

    @staticmethod
    def _table_words(size: int, pages: int) -> int:
        """The int64 words a table of ``pages`` pages for ``size`` rows takes (int32 entries)."""
        return -(-(2 * size + 1 + pages) // 2)

    @staticmethod
    def _table(words: torch.Tensor, size: int, pages: int):
        """The table's three parts in ``words`` (int64, on either side of the copy): int32
        views after the ``4 * size`` words of rows."""
        t = words.view(torch.int32)[8 * size:]
        return t[:size + 1], t[size + 1:2 * size + 1], t[2 * size + 1:2 * size + 1 + pages]

    def stage(self, rows: torch.Tensor, meta: AttentionMetadata | None,
              copy: bool = True) -> int:
        """Write ``rows`` (host ``[4, size]`` int64) and, with ``meta`` (padded to ``size``
        rows), its page table into this turn's pinned buffer, and queue their copy (without
        ``copy``, the graph replayed next reads the buffer itself, and the caller records
        ``copied`` after it). Returns the turn."""
        turn, self.turn = self.turn, self.turn ^ 1
        self.copied[turn].synchronize()  # (normally run: it preceded the replay before last)
        words = self.write(turn, rows, meta)
        if copy:
            self.buffer[:words].copy_(self.host[turn][:words], non_blocking=True)
            self.copied[turn].record()
        return turn

    def write(self, turn: int, rows: torch.Tensor, meta: AttentionMetadata | None) -> int:
        """:meth:`stage`'s writes into pinned buffer ``turn``; returns the words written."""
        size = rows.shape[1]
        host = self.host[turn]
        words = 4 * size
        host[:words].copy_(rows.reshape(-1))
        if meta is not None:
            pages = len(meta.kv_indices)
            if pages > self.pages[size]:
                raise ValueError(f"{pages} pages exceed the {size}-row graph's table")
            for part, value in zip(self._table(host, size, pages),
                                   (meta.kv_indptr, meta.kv_last_page_len, meta.kv_indices)):
                part.copy_(value)
            words += self._table_words(size, pages)
        return words


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


def prompt_graph_max_tokens(configured: int | None, step_budget: int,
                            max_model_len: int) -> int:
    """The largest lone prompt a whole-step graph takes (``cuda_graph_prompt_max_tokens``; None:
    ``PROMPT_GRAPH_MAX_TOKENS``), never more than a step's token budget nor the longest
    sequence (no prompt could use a larger graph).

    Measured on H200s (8B, one prompt a step, docs/benchmarks.md): against the pieces (to 512
    tokens in bf16) or an eager step (beyond), the whole-step graph took 0.5-1.0 ms off prompts
    of 16-512 tokens, 3.1-4.6 ms off 1,024 (bf16, eager before) and 2.4-2.7 ms off 2,048; a
    1,100-token prompt padded to 1,152 rows was still 0.9 ms faster in bf16, and within 1% in
    FP8 (pieces before). Unlike the pieces beside decoding sequences, where bf16 graphs of 1-2k
    tokens lost to padding (``graph_max_tokens``), the whole step's host work is gone here."""
    return min(PROMPT_GRAPH_MAX_TOKENS if configured is None else configured, step_budget,
               max_model_len)


PROMPT_GRAPH_MAX_TOKENS = 2048


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

    A lone prompt with nothing before it in the cache (a request's first step at low load) of
    up to ``prompt_max_tokens`` tokens replays one graph of the whole step instead, attention
    included (:meth:`run_prompt`): padded to a size, every such prompt has the same attention
    plan (``size`` queries over ``size`` keys, causal), so it is made once, at capture, and only
    the prompt's page ids are copied in a step. The padding rows' keys sit after every real
    row's, so the causal mask keeps them from the real rows; the pages past the prompt's own are
    the null block's. Eager attention between 36 pieces costs an 8B step ~0.1 ms of host time a
    layer and its plan ~0.5 ms, more than a short prompt's layers take on the GPU.

    Without ``capture`` (CPU, tests) the pieces run as plain calls over the same buffers, and a
    lone prompt's step runs them with its attention over the same padded shape.
    """

    def __init__(self, runner, max_tokens: int, capture: bool = True,
                 prompt_max_tokens: int = 0):
        self.runner = runner
        self.model = runner.model.model  # Qwen3Model: embed_tokens, layers, norm
        self.sizes = mixed_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        # (the same token counts; beyond the pieces' largest where asked)
        self.prompt_sizes = mixed_sizes(prompt_max_tokens) if prompt_max_tokens else []
        self.use_graphs = capture
        cfg, dev = runner.model.config, runner.device
        attn = self.model.layers[0].self_attn
        m = max([self.max_tokens, *self.prompt_sizes])
        # ids, positions, slots (read by the pieces), the pending-token rows
        self.inputs = torch.zeros(4, m, dtype=torch.int64, device=dev)
        self.queries = torch.zeros(m, attn.num_heads, attn.head_dim, dtype=runner.dtype,
                                   device=dev)
        self.attn_out = torch.zeros_like(self.queries)
        self.residual = torch.zeros(m, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.hidden = torch.zeros(m, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # A lone prompt's: its attention's wrapper per size (planned at capture) and its graph.
        self.prompt_wrappers: dict = {}
        self.prompt_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def prompt_size(self, step) -> int | None:
        """The size whose whole-step graph takes ``step``: one sequence, all of whose context
        is this step's tokens (nothing cached before them), of at most the largest prompt size;
        else None."""
        meta, n = step.meta, len(step.ids)
        if meta.num_seqs != 1 or meta.context_lens[0] != n:
            return None
        return next((s for s in self.prompt_sizes if s >= n), None)

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

    def _prompt_meta(self, size: int, pages: torch.Tensor | None = None) -> AttentionMetadata:
        """A lone prompt padded to ``size`` rows: ``size`` queries over ``size`` keys, in
        ``pages`` (the prompt's own, then the null block's; all the null block's by default)."""
        meta = null_meta(1, size, self.runner.block_size)
        meta.is_decode_only = False
        if pages is not None:
            meta.kv_indices[:len(pages)] = pages
        meta.slot_mapping = self.inputs[2, :size]
        return meta

    def _whole(self, size: int) -> None:
        """A lone prompt's whole step over ``size`` rows: the pieces with attention between
        them, each layer's over every row (in the forward context of :meth:`_prompt_meta`)."""
        layers = self.model.layers
        for i, layer in enumerate(layers):
            self._piece(size, i)
            layer.self_attn.attend(self.queries[:size], out=self.attn_out[:size])
        self._piece(size, len(layers))

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
        backend = self.runner.backend
        for size in tqdm(sorted(self.prompt_sizes, reverse=True),
                         desc="capturing lone-prompt graphs", disable=not progress, leave=False):
            meta = self._prompt_meta(size)
            meta.extras["wrapper"] = self.prompt_wrappers[size] = \
                backend.graph_prompt_wrapper(meta)
            with set_forward_context(meta):
                self._whole(size)  # eager once (its attention kernel's first run)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._whole(size)
            pool = graph.pool()
            self.prompt_graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """As :meth:`DecodeGraphs.release`."""
        torch.cuda.synchronize(self.inputs.device)
        for graph in (*(g for gs in self.graphs.values() for g in gs),
                      *self.prompt_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.prompt_graphs.clear()

    def run(self, step, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Queue the pieces and the eager attention of ``step`` (:class:`StepInputs`, of at most
        ``max_tokens`` tokens), or a lone prompt's whole step (:meth:`prompt_size`); returns
        the final hidden states of its ``n`` rows."""
        n = len(step.ids)
        prompt = self.prompt_size(step)
        size = prompt or self.size_for(n)
        rows = step.host_rows(size)
        self.inputs[:, :size].copy_(rows.pin_memory() if self.use_graphs else rows,
                                    non_blocking=True)
        step.feed_pending(self.inputs[0], self.inputs[3], prev_tokens)
        if prompt is not None:
            self.run_prompt(step, size)
            return self.hidden[:n]
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

    def run_prompt(self, step, size: int) -> None:
        """Queue a lone prompt's whole step (:meth:`prompt_size`; its rows already copied in):
        its page ids into the graph's attention wrapper, then the one replay."""
        meta = self._prompt_meta(size, step.meta.kv_indices)
        if self.use_graphs and size in self.prompt_graphs:
            self.runner.backend.set_prompt_pages(self.prompt_wrappers[size], meta.kv_indices)
            self.prompt_graphs[size].replay()
            return
        with set_forward_context(meta):
            self.runner.backend.plan(meta)
            self._whole(size)

    def _replay(self, graphs, size: int, i: int) -> None:
        if graphs is None:
            with set_forward_context(self._meta_for_capture(size)):
                self._piece(size, i)
        else:
            graphs[i].replay()
