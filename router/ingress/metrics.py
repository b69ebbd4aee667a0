"""Metrics of the ingress: a Prometheus registry of its own (served on the replica's ``/metrics``,
for one process) and, inside a Serve replica, the same series through Ray's metrics system
(tagged with the replica: the cluster's answer, :mod:`contracts.metrics`). The ingress reports
only what it sees (its requests, answers and latencies); KV use and transfers are reported by
the replicas where they happen."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from contracts.metrics import LATENCY_BUCKETS, in_replica, never_raises

# The series the ingress records on requests, each in its Prometheus registry and (in a
# replica) in Ray's: attribute, kind, name, description, label names.
_TEED = (
    ("ttft", "histogram", "baton_time_to_first_token_seconds", "Time to first token", ()),
    ("itl", "histogram", "baton_inter_token_latency_seconds", "Gap between streamed tokens", ()),
    ("e2e", "histogram", "baton_e2e_latency_seconds", "Request latency, end to end", ()),
    ("requests", "counter", "baton_requests", "Requests by outcome", ("outcome",)),
    ("responses", "counter", "baton_responses", "Answers by protocol and status code",
     ("protocol", "code")),
    ("in_flight", "gauge", "baton_requests_in_flight", "Requests being served (queue depth)", ()),
    ("tokens", "counter", "baton_output_tokens", "Output tokens streamed to clients", ()),
    ("migrations", "counter", "baton_request_migrations",
     "Requests moved to another decode replica after theirs was lost", ()),
)


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
            with never_raises():  # a metric never fails a request
                self.twin.observe(v, tags=self.tags)

    def inc(self, v: float = 1) -> None:
        self.prom.inc(v)
        self._twin_add(v)

    def dec(self, v: float = 1) -> None:
        self.prom.dec(v)
        self._twin_add(-v)

    def _twin_add(self, v: float) -> None:
        if self.twin is None:
            return
        with never_raises():  # a metric never fails a request
            if hasattr(self.twin, "set"):  # a gauge
                self.value += v
                self.twin.set(self.value, tags=self.tags)
            elif v > 0:  # Ray's counters refuse an increment of zero
                self.twin.inc(v, tags=self.tags)


def _prom(kind: str, name: str, doc: str, labels: tuple, registry):
    if kind == "histogram":
        return Histogram(name, doc, labels, registry=registry, buckets=LATENCY_BUCKETS)
    return (Counter if kind == "counter" else Gauge)(name, doc, labels, registry=registry)


def _ray(kind: str, name: str, doc: str, labels: tuple):
    from ray.serve import metrics as m
    if kind == "histogram":
        return m.Histogram(name, doc, boundaries=LATENCY_BUCKETS, tag_keys=labels or None)
    return (m.Counter if kind == "counter" else m.Gauge)(name, doc, tag_keys=labels or None)


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
        twinned = in_replica()
        for attr, kind, name, doc, labels in _TEED:
            setattr(self, attr, _Tee(_prom(kind, name, doc, labels, r),
                                     _ray(kind, name, doc, labels) if twinned else None, labels))
        if twinned:
            _GaugeRefresher([self.in_flight])

    def count_http(self, status: int) -> None:
        self.responses.labels("http", str(status)).inc()

    def count_grpc(self, code) -> None:
        """``code``: a ``grpc.StatusCode`` (None: OK)."""
        self.responses.labels("grpc", code.name if code is not None else "OK").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
