"""Prometheus metrics of the ingress, in a registry of its own (no import-time globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtransfer import TransferStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


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
