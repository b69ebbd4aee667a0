"""The dashboard's PromQL evaluated over recorded scrapes (benchmarks.dashboard) agrees with
what Prometheus computes for the same samples."""

import math

import pytest

from benchmarks.dashboard import Labels, Scrape, _Parser, evaluate, panel_series


def _scrape(at, **series):
    samples = {}
    for name, points in series.items():
        samples[name] = {Labels(labels.items()): v for labels, v in points}
    return Scrape(at, samples)


BUCKETS = "h_bucket"


def _hist(at, counts, replica="r1"):
    les = ["0.1", "0.5", "1.0", "+Inf"]
    return [({"le": le, "replica": replica}, c) for le, c in zip(les, counts)]


def test_rate_and_quantile_as_prometheus_computes_them():
    scrapes = [_scrape(0.0, h_bucket=_hist(0, [0, 0, 0, 0]), c_total=[({"k": "a"}, 10.0)]),
               _scrape(10.0, h_bucket=_hist(10, [10, 30, 40, 40]), c_total=[({"k": "a"}, 30.0)])]
    rate = evaluate(_Parser('sum(rate(c_total{k=~"a|b"}[10]))').parse(), scrapes, 10.0)
    assert rate == {Labels(): 2.0}
    q = evaluate(_Parser("histogram_quantile(0.5, sum by (le) (rate(h_bucket[10])))").parse(),
                 scrapes, 10.0)
    # rank 20 of 40: in (0.1, 0.5] holding 10..30 -> 0.1 + 0.4 * (20 - 10) / 20
    assert q[Labels()] == pytest.approx(0.3)
    top = evaluate(_Parser("histogram_quantile(0.99, sum by (le) (rate(h_bucket[10])))")
                   .parse(), scrapes, 10.0)
    assert top[Labels()] == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)


def test_division_matches_labels_and_scales():
    s = [_scrape(0.0, a=[({"d": "x"}, 1.0), ({"d": "y"}, 4.0)], b=[({"d": "x"}, 2.0)])]
    assert evaluate(_Parser("sum by (d) (a) / sum by (d) (b)").parse(), s, 0.0) == \
        {Labels({"d": "x"}.items()): 0.5}
    assert evaluate(_Parser("max by (d) (a) / 1e9").parse(), s, 0.0)[
        Labels({"d": "y"}.items())] == 4e-9


def test_a_panel_has_a_gap_where_a_series_has_no_value():
    panel = {"targets": [{"refId": "A", "expr": 'max by (d) (g{app=~"$app"})',
                          "legendFormat": "g {{d}}"}]}
    scrapes = [_scrape(0.0, g=[({"d": "x", "app": "baton"}, 1.0)]), _scrape(1.0),
               _scrape(2.0, g=[({"d": "x", "app": "baton"}, 3.0)])]
    xs, ys = panel_series(panel, scrapes, 10)["g x"]
    assert xs == [0.0, 1.0, 2.0] and ys[0] == 1.0 and math.isnan(ys[1]) and ys[2] == 3.0
