"""The engine's ranks, driven as one (vLLM v1's executor): rank 0's model and runner in this
process and, for tensor parallelism, the other ranks' processes (:mod:`engine.tp_ranks`) that
run every step with it.

Start-up: rank 0 resolves the model's shape → spawns the other ranks (they join its group) →
builds its own slice (:func:`engine.rank.build_rank`, the path every rank takes) and sizes the
KV cache → the other ranks build theirs with as many blocks → on CUDA every rank warms up and
captures its decode graphs at once. A step: :meth:`Executor.execute` queues the forward pass on
every rank and returns rank 0's logits; after sampling, :meth:`Executor.share_tokens` gives the
other ranks the sampled ids that the next step's pending inputs read.
"""

from __future__ import annotations

import weakref

import torch

from engine.config import EngineConfig
from engine.sampler import Draw
from engine.model_runner import ModelRunner
from engine.parallel import TPGroup, broadcast, check_tp
from engine.scheduler import ScheduledBatch
from engine.tp_ranks import RankProcesses
from engine.rank import build_draft, build_rank, draft_runner, engine_shape


class Executor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels launch on the current device
        self.source, self.dtype, self.max_model_len = engine_shape(config, self.device)
        self.others: RankProcesses | None = None
        try:
            if config.tensor_parallel_size > 1:
                check_tp(self.source.config, config.tensor_parallel_size)
                self.others = RankProcesses(config)
                weakref.finalize(self, self.others.close)  # they stop with the executor
            group = self.others.group if self.others is not None else TPGroup()
            spec = config.speculative_config
            draft, extra = None, 0
            if spec is not None and spec.method == "draft_model":
                draft, extra = build_draft(config, self.device, self.dtype, self.source,
                                           config.show_progress)
            self.runner: ModelRunner = build_rank(config, self.device, group,
                                                  config.show_progress, extra)
            # speculative decoding's draft model (engine.draft_model): rank 0 only, its cache
            # indexed by the target's blocks
            self.draft: ModelRunner | None = None
            if draft is not None:
                self.draft = draft_runner(config, draft, self.device, self.dtype,
                                          self.max_model_len, self.runner.num_blocks)
            if self.others is not None:
                self.others.build(self.runner.num_blocks)
                self.runner.others = self.others
            if self.device.type == "cuda":
                self._warm_up()
        except BaseException:
            self.shutdown()  # the other ranks stop now, not when this object is collected
            raise

    @property
    def model(self):
        return self.runner.model

    def _warm_up(self) -> None:
        """Every rank at once: their collectives (and graph captures) meet."""
        if self.others is not None:
            self.others.warm_up()
        self.runner.warm_up(progress=self.config.show_progress)
        if self.draft is not None:
            self.draft.warm_up(progress=self.config.show_progress)
        if self.others is not None:
            self.others.warmed()

    def execute(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None,
                draws: list[Draw] | None = None) -> torch.Tensor | None:
        """Queue ``batch`` on every rank; rank 0's float32 logits of the sequences due a token
        (``ModelRunner.execute``; with ``draws`` its ``sampled`` may hold their ids)."""
        return self.runner.execute(batch, prev_tokens, draws)

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """The sampled ids, on every other rank's device (the next step's pending inputs)."""
        if self.others is not None:
            broadcast(tokens.to(torch.int64), self.others.group)

    def allocate_host_tier(self, num_blocks: int) -> None:
        """Every rank's host tier: ``num_blocks`` blocks of its slice (engine.kv_offload)."""
        self.runner.allocate_host_tier(num_blocks)
        if self.others is not None:
            self.others.allocate_host_tier(num_blocks)

    def copy_blocks(self, copies, wait: bool = False) -> None:
        """Queue a batch of the host tier's copies (``engine.kv_offload.KVCopies``) on every
        rank, ahead of the next step they send; ``wait``: return once every copy every rank
        has queued has landed."""
        if self.others is not None:
            self.others.copy_blocks(copies, wait)
        self.runner.copy_blocks(copies)
        if wait:
            self.runner.sync_copies()
        if wait and self.others is not None:
            self.others.copied()

    def copies_done(self, copy_id: int) -> bool:
        """Whether rank 0's copy ``copy_id`` has landed (the other ranks' steps wait for theirs
        on their devices: ``KVCopies.waits``)."""
        return self.runner.copies_done(copy_id)

    def sync_copies(self) -> None:
        """Wait until rank 0's queued copies have landed."""
        self.runner.sync_copies()

    def kv_caches(self) -> tuple[tuple, tuple]:
        """Every rank's KV cache (rank 0's first) and the handle another process opens each by
        (None for rank 0's, which is shared as it is); one rank: ``((cache,), (None,))``."""
        others = self.others.kv_caches() if self.others is not None else []
        return ((self.runner.kv_cache, *(c for c, _ in others)),
                (None, *(h for _, h in others)))

    def check_ranks(self) -> None:
        """Raise if a rank of a split engine is gone."""
        if self.others is not None and (dead := self.others.dead()):
            raise RuntimeError(f"tensor-parallel rank(s) {dead} died")

    def kill_ranks(self) -> None:
        """Kill the other ranks now (their process is about to exit)."""
        if self.others is not None:
            self.others.kill()

    def shutdown(self) -> None:
        """Stop the other ranks (nothing to do with one)."""
        if self.others is not None:
            if getattr(self, "runner", None) is not None:
                self.runner.release_graphs()  # before the group ends (DecodeGraphs.release)
            self.others.close()
            self.others = None
