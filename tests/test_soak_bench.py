"""The soak benchmark's summary: memory that levels off and memory that grows."""

import pytest


def test_the_soak_summary_finds_flat_and_growing_memory():
    from benchmarks.soak_bench import slope_mb_per_10min, summarize

    samples = [{"t": t, "rss_mb": {"flat": 400.0 + (t < 60) * 5, "growing": 300 + t / 60}}
               for t in range(0, 1800, 10)]
    summary = summarize(samples, warm_up_s=180)
    assert summary["flat"]["second_half_slope_mb_per_10min"] == 0.0
    assert summary["growing"]["second_half_slope_mb_per_10min"] == pytest.approx(10.0)
    assert summary["growing"]["after_warm_up_mb"] == 303.0
    assert slope_mb_per_10min([(0, 1.0)]) == 0.0
