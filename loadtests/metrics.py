"""Per-request records and what is computed from them: percentiles, throughput, SLO attainment,
goodput.

The locustfile writes one ``RequestRecord`` per request (JSON lines); every figure in a report
is computed here from those records, exactly, never from locust's binned percentiles.

    TTFT         send → first token received (client side)
    ITL          gaps between received tokens: one gap per output token after the first; a
                 message carrying k tokens splits its gap evenly among them
    TPOT         a request's mean inter-token gap, (E2E - TTFT) / (output tokens - 1)
    E2E          send → last byte of the stream
    ITL p99/req  a request's own 99th-percentile inter-token gap (its worst stalls)
    meets SLO    no error, TTFT <= slo.ttft_ms, and, for each bound that is set,
                 TPOT <= slo.itl_ms and ITL p99/req <= slo.itl_p99_ms
    goodput      the highest offered load at which at least ``slo.attainment`` of the requests
                 meet the SLO
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; ``start`` is wall-clock (epoch)."""

    index: int
    protocol: str
    max_tokens: int
    start: float
    group: str = ""
    lag_s: float = 0.0  # open loop: how late the request left against its schedule
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them (from the usage message)
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @property
    def tpot_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None


def read_records(path: Path) -> list[RequestRecord]:
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    return [RequestRecord(**json.loads(line)) for line in lines if line.strip()]


class Slo(BaseModel):
    """Service-level objectives a request must meet to count towards goodput."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float = Field(gt=0)
    itl_ms: float | None = Field(None, gt=0)  # each request's mean gap (TPOT); None: no bound
    itl_p99_ms: float | None = Field(None, gt=0)  # each request's own gap p99; None: no bound
    attainment: float = Field(0.9, gt=0, le=1)

    def met_by(self, rec: RequestRecord) -> bool:
        if rec.error is not None or rec.ttft_s is None:
            return False
        if rec.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = rec.tpot_s
        if self.itl_ms is not None and tpot is not None and tpot * 1e3 > self.itl_ms:
            return False
        p99 = percentile(rec.itl_s, 99) if self.itl_p99_ms is not None else None
        return p99 is None or p99 * 1e3 <= self.itl_p99_ms

    def describe(self) -> str:
        bounds = [f"TTFT ≤ {self.ttft_ms:g} ms"]
        if self.itl_ms is not None:
            bounds.append(f"mean inter-token gap ≤ {self.itl_ms:g} ms")
        if self.itl_p99_ms is not None:
            bounds.append(f"the request's own inter-token p99 ≤ {self.itl_p99_ms:g} ms")
        return ", ".join(bounds[:-1]) + " and " + bounds[-1] if len(bounds) > 1 else bounds[0]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarize(records: list[RequestRecord], slo: Slo, duration_s: float | None = None) -> dict:
    """The figures of one run (one layout at one load) from its per-request records;
    ``duration_s``, the time requests were sent over, gives the rate actually sent and is the
    shortest window throughput is measured over."""
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    window = max(_window_s(records), duration_s or 0.0)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "sent_rps": len(records) / duration_s if duration_s else None,
        "achieved_rps": len(ok) / window if window else 0.0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)), "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "output_tokens": tokens, "output_tok_s": tokens / window if window else 0.0,
        "short_outputs": sum(r.output_tokens != r.max_tokens for r in ok),
        "prompt_tokens_mean": _mean([r.prompt_tokens for r in ok if r.prompt_tokens]),
        "cached_tokens_mean": _mean([r.cached_tokens for r in ok if r.cached_tokens is not None]),
        "lag_p99_ms": _ms(percentile([r.lag_s for r in records], 99)),
        "slo_fraction": (sum(slo.met_by(r) for r in records) / len(records)) if records else 0.0,
        "first_error": next((r.error for r in records if r.error), None),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _window_s(records: list[RequestRecord]) -> float:
    """First send to last answer. Throughput is measured over this span or the run's duration,
    whichever is longer."""
    ends = [r.start + r.e2e_s for r in records if r.e2e_s is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.start for r in records)


def goodput(points: list[tuple[float, float]], attainment: float) -> float | None:
    """The highest load whose SLO fraction is at least ``attainment``; ``points`` are
    (load, slo_fraction) pairs. None when no load meets it."""
    meeting = [load for load, fraction in points if fraction >= attainment]
    return max(meeting) if meeting else None
