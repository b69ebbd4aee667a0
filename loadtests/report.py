"""The sweep's report: ``summary.md`` (a table per layout and load, goodput, failures),
``summary.csv`` and ``summary.json`` (the same figures), and PNG plots with one line per
layout: ``ttft.png`` (p50 solid, p99 dashed), ``itl_p99.png`` and ``throughput.png``.

Every figure comes from ``loadtests.metrics.summarize`` over the per-request records.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from loadtests.config import SweepConfig
from loadtests.layouts import parse_layout
from loadtests.metrics import Slo, goodput, read_records, summarize

COLUMNS = [  # (key, header, format)
    ("layout", "layout", "{}"), ("load", "load", "{:g}"), ("requests", "requests", "{}"),
    ("errors", "errors", "{}"), ("sent_rps", "sent/s", "{:.2f}"),
    ("achieved_rps", "done/s", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"), ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"), ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("e2e_p50_ms", "E2E p50 ms", "{:.0f}"), ("output_tok_s", "output tok/s", "{:.1f}"),
    ("cached_tokens_mean", "cached prompt tok", "{:.0f}"),
    ("slo_fraction", "meets SLO", "{:.0%}"),
]
PLOTS = {"ttft.png": "TTFT p50 (solid) and p99 (dashed)", "itl_p99.png": "inter-token p99",
         "throughput.png": "output tokens/s"}


def load_axis(cfg) -> tuple[str, str]:
    """(axis label, unit) of the sweep's load."""
    return ("offered request rate (req/s, open loop)", "req/s") if cfg.open_loop \
        else ("concurrent users (closed loop)", "users")


def goodput_rows(cfg, points: list[dict], layouts: list[str]) -> list[dict]:
    rows = []
    for layout in layouts:
        mine = sorted((p for p in points if p["layout"] == layout), key=lambda p: p["load"])
        best = goodput([(p["load"], p["slo_fraction"]) for p in mine], cfg.slo.attainment)
        at = next((p for p in mine if p["load"] == best), None)
        rows.append({"layout": layout, "goodput": best, "loads_run": len(mine),
                     "output_tok_s": at["output_tok_s"] if at else None,
                     "ttft_p99_ms": at["ttft_p99_ms"] if at else None,
                     "itl_p99_ms": at["itl_p99_ms"] if at else None})
    return rows


def _cell(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summary_markdown(cfg, points: list[dict], failures: list[dict], meta: dict) -> str:
    label, unit = load_axis(cfg)
    layouts = list(dict.fromkeys([p["layout"] for p in points] + [f["layout"] for f in failures]))
    wl = cfg.workload
    head = [
        f"# Load test: {cfg.out.name}", "",
        f"- model `{cfg.model}`, protocol {cfg.protocol}, load: {label}, {cfg.duration_s:g} s "
        f"per point" + (f", {cfg.arrival} arrivals" if cfg.open_loop else ""),
        f"- workload `{wl.kind}`: input {wl.input_len} tokens, output {wl.output_len} tokens"
        + (f", {wl.num_prefixes} prefixes of {wl.shared_prefix_len()} tokens"
           if wl.kind == "shared-prefix" else "")
        + (f", {wl.turns} turns" if wl.kind == "multi-turn" else "") + f", seed {wl.seed}",
        f"- SLO: {cfg.slo.describe()} for at least {cfg.slo.attainment:.0%} of requests",
        f"- replicas: {cfg.resources.num_gpus:g} GPU and {cfg.resources.num_cpus:g} CPU each; "
        f"engine {json.dumps(cfg.engine_config())}",
        f"- {meta.get('date', '')}, commit {meta.get('commit', '?')}, {meta.get('cluster', '')}",
        "", "## Results", "",
        f"Load in {unit}; latencies over successful requests; `meets SLO` counts errors as "
        "misses; `sent/s` is requests sent over the duration (a Poisson schedule varies "
        "around the offered rate); `done/s` and `output tok/s` are over the duration or from "
        "the first send to the last answer, whichever is longer; `cached prompt tok` "
        "is the mean prompt tokens served from the prefix cache.", "",
        markdown_table([h for _, h, _ in COLUMNS],
                       [[_cell(p.get(k), f) for k, _, f in COLUMNS]
                        for p in sorted(points, key=lambda p: (layouts.index(p["layout"]),
                                                               p["load"]))]),
        "", "## Goodput", "",
        f"The highest load ({unit}) at which at least {cfg.slo.attainment:.0%} of requests met "
        "the SLO.", "",
        markdown_table(["layout", f"goodput ({unit})", "output tok/s there", "TTFT p99 ms there",
                        "ITL p99 ms there"],
                       [[g["layout"], _goodput_cell(g, failures), _cell(g["output_tok_s"], "{:.1f}"),
                         _cell(g["ttft_p99_ms"], "{:.1f}"), _cell(g["itl_p99_ms"], "{:.1f}")]
                        for g in goodput_rows(cfg, points, layouts)]),
    ]
    notes = _warnings(points, cfg)
    if notes:
        head += ["", "## Warnings", ""] + [f"- {n}" for n in notes]
    if failures:
        head += ["", "## Failures", ""] + [
            f"- {f['layout']}" + (f" at {f['load']}" if f["load"] else " (whole layout)")
            + f": {f['error']}" for f in failures]
    head += ["", "## Plots", ""] + [f"![{title}]({name})" for name, title in PLOTS.items()]
    return "\n".join(head) + "\n"


def _goodput_cell(row: dict, failures: list[dict]) -> str:
    if row["goodput"] is not None:
        return f"{row['goodput']:g}"
    if row["loads_run"] == 0 and any(f["layout"] == row["layout"] for f in failures):
        return "failed"
    return "none met"


def _warnings(points: list[dict], cfg) -> list[str]:
    notes = []
    for p in points:
        where = f"{p['layout']} at {p['load']:g}"
        if p["errors"]:
            notes.append(f"{where}: {p['errors']} errors (first: {p['first_error']})")
        if p["short_outputs"]:
            notes.append(f"{where}: {p['short_outputs']} answers with fewer tokens than asked")
        if cfg.open_loop and (p["lag_p99_ms"] or 0) > 100:
            notes.append(f"{where}: sends were up to {p['lag_p99_ms']:.0f} ms late (p99); the "
                         "load generator is short of CPU, so the offered rate was not kept")
    return notes


def write_csv(path: Path, points: list[dict]) -> None:
    keys = list(dict.fromkeys(k for p in points for k in p))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(points)


def write_plots(out: Path, cfg, points: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel, _ = load_axis(cfg)
    layouts = list(dict.fromkeys(p["layout"] for p in points))
    specs = {"ttft.png": ([("ttft_p50_ms", "-", "p50"), ("ttft_p99_ms", "--", "p99")], "TTFT (ms)"),
             "itl_p99.png": ([("itl_p99_ms", "-", "")], "inter-token latency p99 (ms)"),
             "throughput.png": ([("output_tok_s", "-", "")], "output tokens/s")}
    written = []
    for name, (series, ylabel) in specs.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
        for i, layout in enumerate(layouts):
            mine = sorted((p for p in points if p["layout"] == layout), key=lambda p: p["load"])
            for key, style, tag in series:
                xy = [(p["load"], p[key]) for p in mine if p.get(key) is not None]
                if xy:
                    ax.plot(*zip(*xy), style, marker="o", color=f"C{i}",
                            label=f"{layout} {tag}".strip())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{PLOTS[name]} — {cfg.model}, {cfg.workload.kind}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if layouts:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        written.append(out / name)
    return written


def write_report(cfg, points: list[dict], failures: list[dict], meta: dict) -> list[Path]:
    """Write the summary files and plots into ``cfg.out``; returns the paths written."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    layouts = list(dict.fromkeys([p["layout"] for p in points] + [f["layout"] for f in failures]))
    (out / "summary.md").write_text(summary_markdown(cfg, points, failures, meta))
    write_csv(out / "summary.csv", points)
    (out / "summary.json").write_text(json.dumps(
        {"meta": meta, "points": points, "failures": failures,
         "goodput": goodput_rows(cfg, points, layouts)}, indent=1))
    return [out / "summary.md", out / "summary.csv", out / "summary.json",
            *write_plots(out, cfg, points)]


def rebuild(run: Path, slo_overrides: dict | None = None) -> list[Path]:
    """Recompute a finished sweep's report from its records, optionally under other SLOs
    (each key given replaces the saved bound; None lifts it); the failures recorded by the
    sweep are kept."""
    run = Path(run)
    cfg = SweepConfig.model_validate_json((run / "config.json").read_text())
    slo = Slo.model_validate({**cfg.slo.model_dump(), **(slo_overrides or {})})
    cfg = cfg.model_copy(update={"out": run, "slo": slo})
    old = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() \
        else {}
    points = []
    for folder in sorted(p for p in run.glob("*/*/requests.jsonl")):
        layout, label = folder.parent.parent.name, folder.parent.name
        load = next((x for x in cfg.loads() if cfg.label(x) == label), None)
        records = read_records(folder)
        if load is not None and records:
            points.append({"layout": layout, "load": load, "label": label,
                           **summarize(records, cfg.slo, cfg.duration_s)})
    named = [parse_layout(n).name for n in cfg.layouts if n.lower() != "auto"]
    order = list(dict.fromkeys(named + [p["layout"] for p in old.get("points", [])]))
    points.sort(key=lambda p: (order.index(p["layout"]) if p["layout"] in order else len(order),
                               p["layout"], p["load"]))
    return write_report(cfg, points, old.get("failures", []), old.get("meta", {}))


def _bound(text: str) -> float | None:
    return None if text.lower() == "off" else float(text)


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m loadtests.report",
                                description="Rebuild a sweep's report from its request records.")
    p.add_argument("run", type=Path, help="the sweep's results folder")
    # Given flags replace the saved SLO's bounds; "off" lifts an inter-token bound.
    p.add_argument("--slo-ttft-ms", dest="ttft_ms", type=float, default=argparse.SUPPRESS)
    p.add_argument("--slo-itl-ms", dest="itl_ms", type=_bound, default=argparse.SUPPRESS,
                   help="each request's mean inter-token gap (TPOT), ms, or off")
    p.add_argument("--slo-itl-p99-ms", dest="itl_p99_ms", type=_bound,
                   default=argparse.SUPPRESS,
                   help="each request's own inter-token p99, ms, or off")
    p.add_argument("--slo-attainment", dest="attainment", type=float,
                   default=argparse.SUPPRESS)
    a = vars(p.parse_args(argv))
    written = rebuild(a.pop("run"), a)
    print("\n".join(str(w) for w in written))


if __name__ == "__main__":
    main()
