"""Each replica's metrics through Ray's metrics system, recorded where things happen.

Made inside a Serve replica, ``ray.serve.metrics`` tags every series with its application,
deployment and replica; each node's metrics agent exports them (``ray_`` prefixed) on the node's
metrics port, which Prometheus scrapes through the service-discovery file Ray writes
(``docs/serving.md``, "Metrics"). Outside a replica (tests driving a role server directly)
nothing is recorded.

- :class:`EngineMetrics` (decode and prefill replicas): a daemon thread reads the snapshot the
  engine thread publishes after each step (:mod:`engine.snapshot`) once a second and reports
  what changed; it never touches the engine.
- :class:`TransferMetrics` (both sides of a hand-over): bytes, blocks sent and skipped, hand-over
  time, failures by kind.
- :class:`PlacementMetrics` (decode replicas): where each request was prefilled, and why.
- The ingress's are in :mod:`router.ingress.metrics` (also served on its own ``/metrics``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
STEP_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def replica_id() -> str:
    """This Serve replica's id ("" outside one)."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (or Serve not installed)
        return ""


def in_replica() -> bool:
    """Whether this process is a Serve replica (its metrics get the replica's tags)."""
    return bool(replica_id())


def _serve_metrics():
    from ray.serve import metrics
    return metrics


class EngineMetrics:
    """An engine's state, reported every ``interval_s`` (vLLM's engine metrics, ``baton_``
    names; ``docs/serving.md`` lists the mapping), from its ``feed``
    (``engine.snapshot.StatsFeed``); ``info``: what it runs (``AsyncEngine.info``). ``extra``
    adds role gauges (blocks held by transfers)."""

    def __init__(self, feed, info: dict[str, str], interval_s: float = 1.0,
                 extra: Callable[[], dict[str, float]] | None = None):
        m = _serve_metrics()
        self.feed, self.interval_s, self.extra = feed, interval_s, extra
        g = {name: m.Gauge(f"baton_{name}", doc) for name, doc in (
            ("num_requests_running", "Requests in the running batch"),
            ("num_requests_waiting", "Requests waiting to be scheduled"),
            ("num_requests_transferring", "Requests whose KV is being pushed to this engine"),
            ("num_requests_loading", "Requests whose prefix the host KV tier is copying back"),
            ("kv_cache_usage", "Fraction of KV blocks in use"),
            ("kv_blocks_used", "KV blocks in use"),
            ("kv_blocks_free", "KV blocks free"),
            ("kv_blocks_held_by_transfers", "KV blocks leased to in-flight transfers"),
            ("kv_host_blocks_used", "Host-tier KV blocks holding a prefix (kv_offloading_size)"),
            ("kv_host_blocks_free", "Host-tier KV blocks free"))}
        self.gauges = g
        self.counters = {name: m.Counter(f"baton_{name}", doc) for name, doc in (
            ("prompt_tokens", "Prompt tokens of the requests this engine took"),
            ("generation_tokens", "Tokens sampled"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ("num_preemptions", "Sequences preempted (recomputed later)"),
            ("num_starvation_preemptions", "Of the preempted sequences, those preempted for "
             "a request that waited starvation_timeout_s"),
            ("kv_host_hit_blocks", "Prompt blocks found in the host tier (not on the device)"),
            ("kv_offload_bytes_to_host", "KV bytes copied from the device to the host tier"),
            ("kv_offload_bytes_to_device", "KV bytes copied from the host tier to the device"),
            ("kv_offload_seconds_to_host", "Seconds the copies to the host tier took"),
            ("kv_offload_seconds_to_device", "Seconds the copies from the host tier took"),
            ("spec_decode_num_drafts", "Steps of a sequence that verified proposals "
             "(speculative decoding)"),
            ("spec_decode_num_draft_tokens", "Tokens proposed"),
            ("spec_decode_num_accepted_tokens", "Proposed tokens accepted"),
            ("engine_steps", "Engine steps"))}
        self.accepted_per_pos = m.Counter(
            "baton_spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their position in the proposal",
            tag_keys=("position",))
        self.finished = m.Counter("baton_request_success", "Requests ended, by finish reason",
                                  tag_keys=("finish_reason",))
        self.step_time = m.Histogram("baton_engine_step_seconds", "Time inside one engine step",
                                     boundaries=STEP_BUCKETS)
        self.queue_time = m.Histogram("baton_request_queue_time_seconds",
                                      "Time from arrival to first scheduling",
                                      boundaries=LATENCY_BUCKETS)
        self.batch_size = m.Histogram("baton_engine_batch_size", "Sequences in one step",
                                      boundaries=BATCH_BUCKETS)
        # What the replica runs, as vLLM's cache_config_info: a constant 1 with the facts as tags.
        self.info = m.Gauge("baton_engine_info", "What this engine runs (value 1; see the tags)",
                            tag_keys=("model", "dtype", "weights", "kv_cache_dtype"))
        self.info_tags = info
        self._last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-metrics", daemon=True)

    def start(self) -> "EngineMetrics":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.collect()
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                log.exception("engine metrics")

    def collect(self) -> None:
        snap = self.feed.latest
        values = {"num_requests_running": snap.running, "num_requests_waiting": snap.waiting,
                  "num_requests_transferring": snap.transferring,
                  "num_requests_loading": snap.loading,
                  "kv_cache_usage": snap.kv_cache_usage, "kv_blocks_used": snap.kv_blocks_used,
                  "kv_blocks_free": snap.kv_blocks_free,
                  "kv_host_blocks_used": snap.host_blocks_used,
                  "kv_host_blocks_free": snap.host_blocks_free}
        values.update(self.extra() if self.extra is not None else {})
        self.info.set(1, tags=self.info_tags)  # re-set: Ray exports a gauge set since its last report
        for name, value in values.items():
            if name in self.gauges:
                self.gauges[name].set(value)
        stats = snap.stats
        totals = {"prompt_tokens": stats.prompt_tokens,
                  "generation_tokens": stats.output_tokens,
                  "prefix_cache_queries": snap.prefix_cache_queries,
                  "prefix_cache_hits": snap.prefix_cache_hits,
                  "num_preemptions": snap.num_preemptions,
                  "num_starvation_preemptions": snap.num_starvation_preemptions,
                  "kv_host_hit_blocks": snap.host_hit_blocks,
                  "kv_offload_bytes_to_host": snap.host_bytes_to_host,
                  "kv_offload_bytes_to_device": snap.host_bytes_to_device,
                  "kv_offload_seconds_to_host": snap.host_seconds_to_host,
                  "kv_offload_seconds_to_device": snap.host_seconds_to_device,
                  "spec_decode_num_drafts": snap.spec_num_drafts,
                  "spec_decode_num_draft_tokens": snap.spec_num_draft_tokens,
                  "spec_decode_num_accepted_tokens": snap.spec_num_accepted_tokens,
                  "engine_steps": stats.steps}
        for name, total in totals.items():
            self._rise(self.counters[name], name, total)
        for pos, total in enumerate(snap.spec_accepted_per_position):
            self._rise(self.accepted_per_pos, ("accepted_per_pos", pos), total,
                       {"position": str(pos)})
        for reason, total in snap.finished_by_reason.items():
            self._rise(self.finished, ("finished", reason), total, {"finish_reason": reason})
        for queued in self.feed.drain(self.feed.queue_times):
            self.queue_time.observe(queued)
        for seconds, size in self.feed.drain(self.feed.step_samples):
            self.step_time.observe(seconds)
            self.batch_size.observe(size)

    def _rise(self, counter, key, total: float, tags: dict | None = None) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta, tags=tags)
            self._last[key] = total


class TransferMetrics:
    """KV hand-overs seen from one side (``side``: ``sent`` on a prefill replica, ``received``
    on a decode replica)."""

    def __init__(self, side: str):
        m = _serve_metrics()
        self.side = side
        tags = ("backend", "side")
        self.bytes = m.Counter("baton_kv_transfer_bytes", "KV bytes handed over", tag_keys=tags)
        self.blocks = m.Counter("baton_kv_transfer_blocks", "KV blocks by fate (sent, skipped)",
                                tag_keys=("kind", "side"))
        self.seconds = m.Histogram("baton_kv_transfer_seconds", "KV hand-over time",
                                   boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.failures = m.Counter("baton_kv_transfer_failures", "Hand-overs that failed, by kind",
                                  tag_keys=("kind", "side"))

    def record(self, stats) -> None:
        """A hand-over that ended well (a prefix-cache hit may have moved nothing)."""
        tags = {"backend": stats.backend or "none", "side": self.side}
        with never_raises():
            if stats.bytes > 0:  # Ray's counters refuse an increment of zero
                self.bytes.inc(stats.bytes, tags=tags)
            self.seconds.observe(stats.seconds, tags=tags)
            for kind, n in (("sent", stats.blocks_sent), ("skipped", stats.blocks_skipped)):
                if n > 0:
                    self.blocks.inc(n, tags={"kind": kind, "side": self.side})

    def failed(self, kind: str) -> None:
        with never_raises():
            self.failures.inc(1, tags={"kind": kind, "side": self.side})


class PlacementMetrics:
    """Where a decode replica had its requests prefilled, and why (``decode_worker.placement``):
    ``where`` local or remote; ``reason`` short, saturated, long, itl, always, never, no_room,
    prefill_unavailable, prompt_logprobs or colocated."""

    def __init__(self):
        self.placements = _serve_metrics().Counter(
            "baton_prefill_placements", "Requests by where they were prefilled and why",
            tag_keys=("where", "reason"))

    def record(self, where: str, reason: str) -> None:
        with never_raises():
            self.placements.inc(1, tags={"where": where, "reason": reason})


class EarlyStartMetrics:
    """Requests a replica started ahead of their Serve calls (``router.early_start``) by
    ``outcome``: ``claimed`` by their call, or ``dropped`` (the call went elsewhere or never
    came)."""

    def __init__(self):
        self.starts = _serve_metrics().Counter(
            "baton_early_starts", "Requests started ahead of their Serve calls, by outcome",
            tag_keys=("outcome",))

    def record(self, outcome: str) -> None:
        with never_raises():
            self.starts.inc(1, tags={"outcome": outcome})


@contextlib.contextmanager
def never_raises():
    """A metric that cannot be recorded is logged, never raised into a request."""
    try:
        yield
    except Exception:  # noqa: BLE001
        log.exception("recording a metric")
