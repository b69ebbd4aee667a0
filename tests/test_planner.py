"""The planner (``loadtests.plan``) and its simulation (``loadtests.simulate``): the simulated
engine follows the profile's costs, and the commands run end to end on CPU."""

from __future__ import annotations

import json

import pytest

from loadtests import plan
from loadtests.simulate import Profile, SimLayout, Simulation, requests_for

FLAT = dict(model="m", device="d", kv_capacity_tokens=10**6, kv_bytes_per_token=1000,
            prefill=[(0, 10.0), (1000, 20.0)],  # 10 ms + 10 ms per 1,000 tokens
            decode=[(1, 100, 5.0), (100, 100, 5.0)],  # 5 ms a step, whatever the batch
            handover_fixed_ms=2.0, handover_gb_s=1.0)  # + 1 ms per 1,000 tokens of KV


def _profiles(**kw):
    return {1: Profile(**{**FLAT, **kw})}


def test_one_request_colocated_follows_the_profile():
    [req] = Simulation(SimLayout(0, 1), _profiles(serve_overhead_ms=3.0)).run(
        requests_for([0.0], [1000], [4]))
    assert req.first == pytest.approx(0.020 + 0.003)  # the prefill step, the served path
    assert req.gaps == pytest.approx([0.005] * 3)  # one decode step per token


def test_a_handed_over_request_pays_the_hop_and_lands_on_the_decode_replica():
    [req] = Simulation(SimLayout(1, 1), _profiles()).run(requests_for([0.0], [1000], [2]))
    # prefill 20 ms, hand-over 2 ms + 1 ms, then the decode replica's first step (5 ms)
    assert req.first == pytest.approx(0.028)
    assert req.gaps == pytest.approx([0.005])


def test_a_hand_over_waits_for_a_slot_on_the_decode_replica():
    """A decode replica holds ``max_num_seqs`` sequences: the third of three prompts sent at
    once is prefilled only once one of the first two has ended, as Baton's reservation waits
    for a slot; with the sweep's drain as a deadline, what has not ended by then is an
    error."""
    from loadtests.simulate import simulate

    reqs = Simulation(SimLayout(1, 1), _profiles(max_num_seqs=2)).run(
        requests_for([0.0] * 3, [1000] * 3, [10] * 3))
    first_end = min(r.tokens[-1] for r in reqs[:2])
    assert reqs[2].first > first_end + 0.020  # then its own prefill, 20 ms
    free = Simulation(SimLayout(1, 1), _profiles()).run(requests_for([0.0] * 3, [1000] * 3,
                                                                      [10] * 3))
    assert free[2].first < first_end
    late = simulate(SimLayout(1, 1), _profiles(max_num_seqs=2),
                    requests_for([0.0] * 3, [1000] * 3, [10] * 3), deadline_s=first_end + 0.01)
    assert late["errors"] == 1 and late["slo_fraction"] == pytest.approx(2 / 3)


def test_pushes_into_one_decode_replica_come_in_one_after_another():
    """Two prompts prefilled in one step: the second's KV arrives after the first's (1 ms of
    bytes each here), so it misses the decode step the first one joins."""
    a, b = Simulation(SimLayout(1, 1), _profiles()).run(requests_for([0.0, 0.0], [1000, 1000],
                                                                     [2, 2]))
    assert b.first == pytest.approx(a.first + 0.005)  # the next decode step
    two = Simulation(SimLayout(1, 2), _profiles()).run(requests_for([0.0, 0.0], [1000, 1000],
                                                                    [2, 2]))
    assert two[0].first == pytest.approx(two[1].first)  # a link each


def test_the_command_line_replaces_the_profiles_hand_over_costs(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(Profile(**FLAT).model_dump_json())
    args = type("A", (), {"handover_fixed_ms": 7.0, "handover_gb_s": 13.0,
                          "serve_overhead_ms": None})()
    [p] = plan.load_profiles([path], args).values()
    assert (p.handover_fixed_ms, p.handover_gb_s, p.serve_overhead_ms) == (7.0, 13.0, 0.0)


def test_auto_keeps_a_short_prompt_where_it_decodes():
    layout = SimLayout(1, 1, mode="auto", max_local_prefill_length=500)
    short, long = Simulation(layout, _profiles()).run(requests_for([0.0, 1.0], [100, 1000],
                                                                   [1, 1]))
    assert short.first == pytest.approx(0.011)  # prefilled here: no hop
    assert long.first - long.arrival == pytest.approx(0.028)


def test_replicas_sharing_a_gpu_share_its_time():
    """A second prompt arrives while the first decodes, on 1P1D: with a GPU per replica its
    prefill does not touch the first one's steps; on one shared GPU both slow while they
    overlap (each at half speed), and two colocated replicas' simultaneous 20 ms prefill steps
    both end at 40 ms."""
    def run(gpus):
        return Simulation(SimLayout(1, 1, gpus_per_replica=gpus), _profiles()).run(
            requests_for([0.0, 0.1], [1000, 1000], [50, 2]))
    (a_apart, b_apart), (a_shared, b_shared) = run(1.0), run(0.5)
    assert max(a_apart.gaps) == pytest.approx(0.005)
    assert max(a_shared.gaps) > 0.009
    assert b_shared.first - b_shared.arrival > b_apart.first - b_apart.arrival + 0.01
    one_gpu = Simulation(SimLayout(0, 2, gpus_per_replica=0.5), _profiles()).run(
        requests_for([0.0, 0.0], [1000, 1000], [1, 1]))
    assert [r.first for r in one_gpu] == pytest.approx([0.040, 0.040])


def test_a_step_costs_the_decode_and_the_prefill_above_its_fixed_part():
    p = Profile(**FLAT)
    assert p.prefill_fixed_ms() == pytest.approx(10.0)
    assert p.step_ms(10, 100, 1000) == pytest.approx(5.0 + 20.0 - 10.0)
    assert p.handover_ms(2000) == pytest.approx(4.0)


def test_layouts_for_two_gpus():
    assert sorted(x.name for x in plan.layouts_for(2, [1])) == ["1p1d", "colo1", "colo2"]
    names = {x.name for x in plan.layouts_for(4, [1, 2])}
    assert {"colo4", "colo2tp2", "1ptp21d", "2p1dtp2"} <= names


def test_plan_ranks_layouts_by_goodput_per_gpu(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(Profile(**FLAT).model_dump_json())
    out = tmp_path / "plan.json"
    plan.main(["plan", "--profile", str(path), "--gpus", "2", "--input-len", "1000",
               "--output-len", "20", "--ttft-ms", "200", "--itl-ms", "20", "--duration", "10",
               "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["goodput_rps_per_gpu"] for r in rows] == sorted(
        (r["goodput_rps_per_gpu"] for r in rows), reverse=True)
    assert all(r["goodput_rps"] > 1 for r in rows)
    assert "goodput req/s" in capsys.readouterr().out


def test_profile_on_cpu_then_validate_against_the_measured_cpu_sweep(tmp_path, capsys):
    """The profile command on the tiny model (small grids), and the validation of the sweep
    kept in docs/data/planner_cpu (its measured points, each predicted)."""
    out = tmp_path / "tiny.json"
    plan.main(["profile", "--model", "tiny", "--prefill-lengths", "16,64", "--batches", "1,4",
               "--contexts", "32", "--engine", '{"num_blocks": 256}', "--out", str(out)])
    profile = Profile.model_validate_json(out.read_text())
    assert len(profile.prefill) == 2 and len(profile.decode) == 2 and profile.mixed
    rows_json = tmp_path / "rows.json"
    plan.main(["validate", "--profile", "docs/data/planner_cpu/profile_tiny.json",
               "docs/data/planner_cpu/sweep", "--json", str(rows_json)])
    rows = json.loads(rows_json.read_text())
    assert len(rows) == 8 and {r["layout"] for r in rows} == {"colo1", "1p1d"}
    assert "median error" in capsys.readouterr().out
