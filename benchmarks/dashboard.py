"""The Grafana dashboard (``deploy/grafana/baton.json``) drawn with matplotlib from scrapes of
Ray's metrics export taken during a run: the dashboard's own PromQL, evaluated here over the
recorded samples, so a run on a machine without Prometheus or Grafana still gets its picture.

    rec = Recorder(metrics_export_port).start()   # scrapes every ``interval_s``
    ...                                            # the load
    rec.stop(); render(rec.scrapes, "dashboard.png")

The evaluator covers the PromQL the dashboard uses and nothing more: selectors with ``=`` and
``=~`` matchers, ``rate(x[w])``, ``sum``/``max`` with ``by (...)``, ``histogram_quantile`` and
``/`` (between vectors with equal labels, or by a number). ``$app`` matches every application;
``$__rate_interval`` is ``rate_window_s``.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "baton.json"

Labels = frozenset  # of (name, value) pairs
Vector = dict  # Labels -> float


@dataclass
class Scrape:
    at: float
    samples: dict[str, dict[Labels, float]]  # metric name -> series


def scrape(port: int, prefix: str = "ray_baton_") -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                samples.setdefault(s.name, {})[Labels(s.labels.items())] = s.value
    return Scrape(time.time(), samples)


@dataclass
class Recorder:
    """Scrapes a metrics port every ``interval_s`` on a daemon thread (a failed scrape is
    skipped: the export may not be up yet)."""
    port: int
    interval_s: float = 2.0
    scrapes: list[Scrape] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scrape", daemon=True)

    def start(self) -> "Recorder":
        self._thread.start()
        return self

    def stop(self) -> list[Scrape]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.scrapes

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrapes.append(scrape(self.port))
            except Exception:  # noqa: BLE001 - the export may not be up yet
                pass
            self._stop.wait(self.interval_s)


# -- the PromQL subset ------------------------------------------------------------------------
_TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:e\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|'
                    r'(?P<op>=~|[(){}\[\],=/])|(?P<name>[A-Za-z_][A-Za-z0-9_]*))')


def _tokens(expr: str) -> list[str]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:]!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


class _Parser:
    """Parses into nested tuples: ("num", x), ("sel", name, matchers, window_s | None),
    ("rate", sel), ("agg", op, by | None, arg), ("hq", q, arg), ("div", a, b)."""

    def __init__(self, expr: str):
        self.toks, self.i = _tokens(expr), 0

    def parse(self):
        node = self.expr()
        if self.i != len(self.toks):
            raise ValueError(f"unexpected {self.toks[self.i]!r}")
        return node

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.toks[self.i]
        if want is not None and tok != want:
            raise ValueError(f"expected {want!r}, found {tok!r}")
        self.i += 1
        return tok

    def expr(self):
        node = self.term()
        while self.peek() == "/":
            self.take()
            node = ("div", node, self.term())
        return node

    def term(self):
        tok = self.take()
        if tok == "(":
            node = self.expr()
            self.take(")")
            return node
        if re.fullmatch(r"\d.*", tok):
            return ("num", float(tok))
        if tok == "histogram_quantile":
            self.take("(")
            q = float(self.take())
            self.take(",")
            arg = self.expr()
            self.take(")")
            return ("hq", q, arg)
        if tok == "rate":
            self.take("(")
            arg = self.expr()
            self.take(")")
            return ("rate", arg)
        if tok in ("sum", "max"):
            by = None
            if self.peek() == "by":
                self.take()
                self.take("(")
                by = []
                while self.peek() != ")":
                    by.append(self.take())
                    if self.peek() == ",":
                        self.take()
                self.take(")")
            self.take("(")
            arg = self.expr()
            self.take(")")
            return ("agg", tok, by, arg)
        matchers, window = [], None
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), json.loads(self.take())
                matchers.append((label, op, value))
                if self.peek() == ",":
                    self.take()
            self.take("}")
        if self.peek() == "[":
            self.take()
            window = float(self.take())
            self.take("]")
        return ("sel", tok, matchers, window)


def _matches(labels: Labels, matchers) -> bool:
    have = dict(labels)
    for label, op, value in matchers:
        got = have.get(label, "")
        if (op == "=" and got != value) or (op == "=~" and not re.fullmatch(value, got)):
            return False
    return True


def _at(scrapes: list[Scrape], t: float) -> Scrape | None:
    """The last scrape taken at or before ``t``."""
    found = None
    for s in scrapes:
        if s.at > t:
            break
        found = s
    return found


def _select(scrape_: Scrape | None, name: str, matchers) -> Vector:
    if scrape_ is None:
        return {}
    return {k: v for k, v in scrape_.samples.get(name, {}).items() if _matches(k, matchers)}


def evaluate(node, scrapes: list[Scrape], t: float) -> Vector | float:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "sel":
        return _select(_at(scrapes, t), node[1], node[2])
    if kind == "rate":
        _, name, matchers, window = node[1]
        now, then = _at(scrapes, t), _at(scrapes, t - window)
        if now is None or then is None or now.at <= then.at:
            return {}
        new, old = _select(now, name, matchers), _select(then, name, matchers)
        # A series that appears within the window rose from nothing (Ray exports a counter
        # once it has been incremented).
        return {k: max(v - old.get(k, 0.0), 0.0) / (now.at - then.at) for k, v in new.items()}
    if kind == "agg":
        _, op, by, arg = node
        groups: dict[Labels, list[float]] = {}
        for labels, v in evaluate(arg, scrapes, t).items():
            key = Labels((k, x) for k, x in labels if by is not None and k in by)
            groups.setdefault(key, []).append(v)
        return {k: (sum(vs) if op == "sum" else max(vs)) for k, vs in groups.items()}
    if kind == "hq":
        return _quantile(node[1], evaluate(node[2], scrapes, t))
    if kind == "div":
        a, b = evaluate(node[1], scrapes, t), evaluate(node[2], scrapes, t)
        if isinstance(b, float):
            return {k: v / b for k, v in a.items()}
        return {k: (v / b[k] if b[k] else math.nan) for k, v in a.items() if k in b}
    raise ValueError(kind)


def _quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus's histogram_quantile: linear within the bucket that holds the rank."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, v in buckets.items():
        le = dict(labels)["le"]
        key = Labels((k, x) for k, x in labels if k != "le")
        groups.setdefault(key, []).append((float(le), v))
    out = {}
    for key, bs in groups.items():
        bs.sort()
        total = bs[-1][1]
        if total <= 0:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper, count in bs:
            if count >= rank:
                if math.isinf(upper):
                    out[key] = lower
                elif count == below:
                    out[key] = upper
                else:
                    out[key] = lower + (upper - lower) * (rank - below) / (count - below)
                break
            lower, below = upper, count
    return out


def panel_series(panel: dict, scrapes: list[Scrape], rate_window_s: float
                 ) -> dict[str, tuple[list[float], list[float]]]:
    """Each target's series of a dashboard panel over the recorded scrapes: legend -> (t, y)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    if not scrapes:
        return series
    xs = [s.at - scrapes[0].at for s in scrapes]
    for target in panel["targets"]:
        expr = (target["expr"].replace("$__rate_interval", f"{rate_window_s:g}")
                .replace('"$app"', '".*"'))
        node = _Parser(expr).parse()
        for i, s in enumerate(scrapes):
            for labels, v in evaluate(node, scrapes, s.at).items():
                legend = re.sub(r"\{\{(\w+)\}\}", lambda m: dict(labels).get(m[1], ""),
                                target.get("legendFormat", "")) or target["refId"]
                _, ys = series.setdefault(legend.strip(), (xs, [math.nan] * len(xs)))
                ys[i] = v  # no value: a gap in the line, as Grafana draws it
    return series


def _right_axis(panel: dict, legend: str) -> bool:
    """Whether an override of the panel puts this series on a right axis (byRegexp only)."""
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o["matcher"]["id"] == "byRegexp" and re.fullmatch(o["matcher"]["options"], legend):
            return any(p["id"] == "custom.axisPlacement" and p["value"] == "right"
                       for p in o["properties"])
    return False


def render(scrapes: list[Scrape], png: str | Path, title: str = "",
           rate_window_s: float = 10.0, marks: list[tuple[float, str]] = (),
           dashboard: Path = DASHBOARD) -> dict[str, int]:
    """Draw every panel where the dashboard puts it, on one time axis (``marks``: (Unix time,
    label) drawn as dashed lines, e.g. where each phase of a benchmark began); returns the
    number of series per panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(dashboard.read_text())["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(18, rows * 0.42))
    if title:
        fig.suptitle(title, fontsize=11)
    counts = {}
    for p in panels:
        g = p["gridPos"]
        ax = fig.add_axes([g["x"] / 24 + 0.035, 1 - (g["y"] + g["h"]) / rows + 0.03,
                           g["w"] / 24 - 0.055, g["h"] / rows - 0.06])
        series = panel_series(p, scrapes, rate_window_s)
        counts[p["title"]] = sum(any(not math.isnan(y) for y in ys) for _, ys in series.values())
        right = None
        for n, (legend, (xs, ys)) in enumerate(sorted(series.items())):
            on = ax
            if _right_axis(p, legend):
                right = right or ax.twinx()
                right.tick_params(labelsize=7)
                on = right
            on.plot(xs, ys, label=legend, linewidth=1, color=f"C{n % 10}")
        if scrapes:
            ax.set_xlim(0, scrapes[-1].at - scrapes[0].at)
            for at, label in marks:
                ax.axvline(at - scrapes[0].at, color="grey", linestyle="--", linewidth=0.7)
                ax.text(at - scrapes[0].at, 1.0, label, fontsize=6, color="grey", rotation=90,
                        va="top", ha="right", transform=ax.get_xaxis_transform())
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(p["title"] + (f"  [{unit}]" if unit not in ("", "short") else ""),
                     fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            lines = [ln for ln in [*ax.get_lines(), *(right.get_lines() if right else [])]
                     if not ln.get_label().startswith("_")]
            ax.legend(lines, [ln.get_label() for ln in lines], fontsize=6, loc="upper left",
                      ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.text(0.5, 0.003, "seconds since the first scrape", ha="center", fontsize=8)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return counts
