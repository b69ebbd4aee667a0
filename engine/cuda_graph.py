"""CUDA graphs of the decode step, one per batch size in a fixed set.

Each graph covers embedding → all layers → final norm → logits for ``size`` sequences of one
query token each, reading its inputs from static buffers (token ids, positions, slot mapping)
and writing float32 logits into a static buffer. A step of ``n`` sequences replays the smallest
graph with ``size >= n``: rows past ``n`` are padding (token 0 at position 0, slot -1 so nothing
is stored, one page of the null block). Graphs are captured largest first into one shared
memory pool. Attention uses one FlashInfer decode wrapper with fixed index buffers per size,
re-planned on the host before each replay.
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        t0 = time.perf_counter()
        pool = None
        model = self.runner.model
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing decode graphs",
                         disable=not progress, leave=False):
            meta = null_meta(size, 1, self.runner.block_size)
            self.backend.plan_decode(self.wrappers[size], meta)
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
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """Wait for the replays queued and free the graphs. A split engine does this before its
        NCCL group ends: a communicator whose work a live graph holds does not end (NCCL's
        shutdown waits for that work, pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.inputs.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def run(self, step, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Queue a replay for the ``n`` sequences of ``step`` (:class:`StepInputs`); returns
        float32 logits ``[n, vocab]`` (valid once the replay has run). A fresh pinned buffer per
        call: the previous step's copy may still be queued behind the running step."""
        n = len(step.ids)
        size = self.size_for(n)
        self.inputs[:, :size].copy_(step.host_rows(size).pin_memory(), non_blocking=True)
        step.feed_pending(self.inputs[0], self.inputs[3], prev_tokens)
        self.backend.plan_decode(self.wrappers[size], self._padded_meta(step.meta, size))
        self.graphs[size].replay()
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
