"""What other threads may know of an engine: a snapshot the engine thread publishes after each
step, as vLLM v1 sends its scheduler stats with each step's outputs.

The engine's own objects (scheduler, block pool, sequences) are touched by the engine thread
only. After every step (and every turn that ran commands) that thread publishes an immutable
:class:`EngineSnapshot` in a :class:`StatsFeed` and moves the step-time and queue-time samples
taken since into the feed's queues; a metrics thread, a load report or a benchmark reads the
feed, never the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0  # sequences in the running batch
    waiting: int = 0
    transferring: int = 0  # decode role: awaiting pushed KV
    loading: int = 0  # awaiting the host tier's copies of their prefix (kv_offloading_size)
    queued_prompt_tokens: int = 0  # prompt tokens still to prefill (waiting, chunked)
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_starvation_preemptions: int = 0  # of those, for a request past starvation_timeout_s
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    stats: object = None  # engine.llm_engine.EngineStats, a copy
    # The host tier (kv_offloading_size; zeros without it): blocks held and free, blocks found
    # there, bytes copied each way
    host_blocks_used: int = 0
    host_blocks_free: int = 0
    host_hit_blocks: int = 0
    host_bytes_to_host: int = 0
    host_bytes_to_device: int = 0
    # seconds the copies that have landed took each way (on the side stream; rank 0), and the
    # bytes those copies moved: their rates, against the host link's
    host_seconds_to_host: float = 0.0
    host_seconds_to_device: float = 0.0
    host_timed_bytes_to_host: int = 0
    host_timed_bytes_to_device: int = 0
    # speculative decoding (vLLM's figures): steps that verified proposals, proposals, those
    # accepted, and accepted ones by position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        total = self.kv_blocks_used + self.kv_blocks_free
        return self.kv_blocks_used / total if total else 0.0

    @property
    def hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


def snapshot_of(engine) -> EngineSnapshot:
    """``engine``'s state now (engine thread only)."""
    sched, pool = engine.scheduler, engine.pool
    return EngineSnapshot(
        running=len(sched.running), waiting=len(sched.waiting),
        transferring=len(sched.transferring), loading=len(sched.loading),
        queued_prompt_tokens=sched.queued_prompt_tokens(),
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_free=pool.num_free_blocks, prefix_cache_queries=pool.query_tokens,
        prefix_cache_hits=pool.hit_tokens, num_preemptions=sched.num_preemptions,
        num_starvation_preemptions=sched.num_starvation_preemptions,
        finished_by_reason=dict(sched.finished_by_reason), stats=replace(engine.stats),
        **spec_figures(engine),
        **host_tier_figures(engine))


def spec_figures(engine) -> dict:
    spec = getattr(engine, "spec_stats", None)
    if spec is None or not spec.num_drafts:
        return {}
    return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_position": tuple(spec.accepted_per_position)}


def host_tier_figures(engine) -> dict:
    tier = getattr(engine, "host_tier", None)
    if tier is None:
        return {}
    block = engine.runner.block_bytes
    return {"host_blocks_used": tier.num_used_blocks,
            "host_blocks_free": tier.num_blocks - tier.num_used_blocks,
            "host_hit_blocks": tier.hit_blocks,
            "host_bytes_to_host": tier.stored_blocks * block,
            "host_bytes_to_device": tier.loaded_blocks * block,
            **{f"host_{kind}_{way}": value for way, (nbytes, seconds)
               in engine.runner.copy_totals.items()
               for kind, value in (("seconds", seconds), ("timed_bytes", nbytes))}}


class StatsFeed:
    """The latest snapshot, and the samples handed over with it (bounded: unread samples are
    dropped, never piled up). Written by the engine thread, read by any."""

    def __init__(self, engine):
        self.latest = snapshot_of(engine)
        self.step_samples: deque[tuple[float, int]] = deque(maxlen=4096)  # (seconds, sequences)
        self.queue_times: deque[float] = deque(maxlen=4096)  # arrival to first scheduling

    def publish(self, engine) -> None:
        """Engine thread: the state after a step, and the samples taken since the last."""
        self.latest = snapshot_of(engine)
        _move(engine.step_samples, self.step_samples)
        _move(engine.scheduler.queue_times, self.queue_times)

    @staticmethod
    def drain(samples: deque) -> list:
        """Take every sample queued so far (any thread)."""
        taken = []
        while True:
            try:
                taken.append(samples.popleft())
            except IndexError:
                return taken


def _move(source: deque, sink: deque) -> None:
    while source:
        sink.append(source.popleft())
