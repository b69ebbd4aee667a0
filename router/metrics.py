"""Metrics of the ingress: a Prometheus registry of its own (served on the replica's ``/metrics``,
for one process) and, inside a Serve replica, the same series through Ray's metrics system
(tagged with the replica: the cluster's answer, :mod:`deploy.metrics`)."""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtransfer import TransferStats

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Tee:
    """A Prometheus metric and, when in a replica, its Ray twin: ``observe``, ``inc``, ``dec``
    and ``labels`` go to both (a Ray gauge is set to the value the Prometheus one holds)."""

    def __init__(self, prom, twin=None, names: tuple = (), tags: dict | None = None):
        self.prom, self.twin, self.names, self.tags = prom, twin, names, tags
        self.value = 0.0

    def labels(self, *values) -> "_Tee":
        return _Tee(self.prom.labels(*values), self.twin, self.names,
                    dict(zip(self.names, values)))

    def observe(self, v: float) -> None:
        self.prom.observe(v)
        if self.twin is not None:
            try:
                self.twin.observe(v, tags=self.tags)
            except Exception:  # noqa: BLE001 - a metric never fails a request
                log.exception("recording a metric")

    def inc(self, v: float = 1) -> None:
        self.prom.inc(v)
        self._twin_add(v)

    def dec(self, v: float = 1) -> None:
        self.prom.dec(v)
        self._twin_add(-v)

    def set(self, v: float) -> None:
        self.prom.set(v)

    def _twin_add(self, v: float) -> None:
        if self.twin is None:
            return
        try:
            if hasattr(self.twin, "set"):  # a gauge
                self.value += v
                self.twin.set(self.value, tags=self.tags)
            elif v > 0:  # Ray's counters refuse an increment of zero
                self.twin.inc(v, tags=self.tags)
        except Exception:  # noqa: BLE001 - a metric never fails a request
            log.exception("recording a metric")


def _twins() -> dict | None:
    from deploy.metrics import LATENCY_BUCKETS, in_replica
    if not in_replica():
        return None
    from ray.serve import metrics as m
    return {
        "ttft": m.Histogram("baton_time_to_first_token_seconds", "Time to first token",
                            boundaries=LATENCY_BUCKETS),
        "itl": m.Histogram("baton_inter_token_latency_seconds", "Gap between streamed tokens",
                           boundaries=LATENCY_BUCKETS),
        "e2e": m.Histogram("baton_e2e_latency_seconds", "Request latency, end to end",
                           boundaries=LATENCY_BUCKETS),
        "requests": m.Counter("baton_requests", "Requests by outcome", tag_keys=("outcome",)),
        "in_flight": m.Gauge("baton_requests_in_flight", "Requests being served"),
        "tokens": m.Counter("baton_output_tokens", "Output tokens streamed to clients"),
        "migrations": m.Counter("baton_request_migrations", "Requests moved to another decode "
                                "replica after theirs was lost"),
    }


class _GaugeRefresher:
    """Ray exports a gauge's value only in the report that follows a ``set``: the ingress's
    gauges move on requests, so their values are set again every second to stay in the export
    (the engines' gauges are read and set every second anyway)."""

    def __init__(self, tees: list[_Tee], interval_s: float = 1.0):
        self.tees, self.interval_s = tees, interval_s
        threading.Thread(target=self._loop, name="gauge-refresh", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            for tee in self.tees:
                tee._twin_add(0.0)


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("baton_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("baton_inter_token_latency_seconds", "Gap between streamed tokens",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("baton_e2e_latency_seconds", "Request latency, end to end",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("baton_requests", "Requests by outcome", ["outcome"], registry=r)
        self.in_flight = Gauge("baton_requests_in_flight", "Requests being served (queue depth)",
                               registry=r)
        self.tokens = Counter("baton_output_tokens", "Output tokens", registry=r)
        self.migrations = Counter("baton_request_migrations",
                                  "Requests moved to another decode replica after theirs was lost",
                                  registry=r)
        self.kv_used = Gauge("baton_kv_blocks_used", "KV blocks in use (decode replica)",
                             registry=r)
        self.kv_free = Gauge("baton_kv_blocks_free", "KV blocks free (decode replica)",
                             registry=r)
        self.kv_held = Gauge("baton_kv_blocks_held_by_transfers",
                             "KV blocks leased to in-flight transfers (decode replica)", registry=r)
        self.hit_rate = Gauge("baton_prefix_cache_hit_rate", "Prefix-cache hit rate (decode)",
                              registry=r)
        self.transfer_bytes = Counter("baton_kv_transfer_bytes", "KV bytes pushed to decode",
                                      ["backend"], registry=r)
        self.transfer_blocks = Counter("baton_kv_transfer_blocks", "KV blocks by fate", ["kind"],
                                       registry=r)
        self.transfer_time = Histogram("baton_kv_transfer_seconds", "KV hand-over time",
                                       ["backend"], registry=r, buckets=_LATENCY_BUCKETS)
        twins = _twins() or {}
        for name, names in (("ttft", ()), ("itl", ()), ("e2e", ()), ("requests", ("outcome",)),
                            ("in_flight", ()), ("tokens", ()), ("migrations", ())):
            setattr(self, name, _Tee(getattr(self, name), twins.get(name), names))
        if twins:
            _GaugeRefresher([self.in_flight])

    def record_transfer(self, t: TransferStats | None) -> None:
        if t is not None:
            self.transfer_bytes.labels(t.backend).inc(t.bytes)
            self.transfer_blocks.labels("sent").inc(t.blocks_sent)
            self.transfer_blocks.labels("skipped").inc(t.blocks_skipped)
            self.transfer_time.labels(t.backend).observe(t.seconds)

    def set_kv(self, load: dict) -> None:
        self.kv_used.set(load["used_blocks"])
        self.kv_free.set(load["free_blocks"])
        self.kv_held.set(load.get("held_blocks", 0))
        self.hit_rate.set(load.get("hit_rate", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
