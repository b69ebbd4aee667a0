"""Load tests: workloads are seeded and shaped as asked, percentiles and goodput are computed
exactly, layouts and the command line refuse bad input; a short CPU sweep (two layouts, two
rates, tiny) writes the CSVs, plots and summary with no errors and every token asked for, and a
layout that cannot be placed is reported while the sweep goes on (gRPC user)."""

import csv
import json
import random

import pytest

from loadtests import report
from loadtests import workloads as W
from loadtests.config import SweepConfig
from loadtests.layouts import Resources, auto_layouts, missing_resources, parse_layout
from loadtests.metrics import RequestRecord, Slo, goodput, percentile, read_records, summarize

ENGINE = {"model": "tiny", "num_blocks": 256, "max_num_seqs": 16}


class WordTokenizer:
    """One token per word: enough to check text prompts without any model files."""

    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("w" * max(1, i) for i in ids)


IDS = W.TokenIdPrompts(vocab_size=1000)


def _build(kind, maker=IDS, **kw):
    return W.build(W.WorkloadSpec(kind=kind, **kw), maker)


@pytest.mark.parametrize("kind", ["fixed", "uniform", "shared-prefix", "multi-turn"])
def test_workloads_are_seeded(kind):
    a = _build(kind, num_requests=12, input_len=40, output_len=8, seed=3)
    assert a == _build(kind, num_requests=12, input_len=40, output_len=8, seed=3)
    assert a != _build(kind, num_requests=12, input_len=40, output_len=8, seed=4)
    assert len(a) == 12 and [r.index for r in a] == list(range(12))


def test_fixed_and_uniform_lengths():
    fixed = _build("fixed", num_requests=20, input_len=33, output_len=7)
    assert {len(r.prompt) for r in fixed} == {33} and {r.max_tokens for r in fixed} == {7}
    uni = _build("uniform", num_requests=200, input_len=100, output_len=10, input_min=20,
                 input_max=60, output_min=3, output_max=5)
    assert all(20 <= len(r.prompt) <= 60 and 3 <= r.max_tokens <= 5 for r in uni)
    assert len({len(r.prompt) for r in uni}) > 20  # really drawn, not fixed
    assert all(10 <= t < 1000 for r in uni for t in r.prompt)
    default = _build("uniform", num_requests=100, input_len=100, output_len=10)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.max_tokens <= 15 for r in default)


def test_shared_prefix_is_really_shared():
    reqs = _build("shared-prefix", num_requests=60, input_len=64, prefix_len=48,
                  num_prefixes=3, output_len=4)
    prefixes = {}
    for r in reqs:
        assert len(r.prompt) == 64
        prefixes.setdefault(r.group, set()).add(tuple(r.prompt[:48]))
    assert len(prefixes) == 3 and all(len(p) == 1 for p in prefixes.values())
    assert len({p for ps in prefixes.values() for p in ps}) == 3
    assert len({tuple(r.prompt[48:]) for r in reqs}) == 60  # each request its own tail


def test_multi_turn_prompts_grow_by_whole_turns():
    reqs = _build("multi-turn", num_requests=24, input_len=10, output_len=5, turns=3,
                  conversations_in_flight=4)
    by_chat = {}
    for r in reqs:
        by_chat.setdefault(r.group, []).append(r)
    assert len(by_chat) == 8 and all(len(v) == 3 for v in by_chat.values())
    for turns in by_chat.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt[:len(prev.prompt)] == prev.prompt  # the earlier turn, verbatim
            assert len(nxt.prompt) == len(prev.prompt) + 5 + 10  # + reply + user message
            assert nxt.index - prev.index == 4  # the other chats' turns come in between


def test_text_prompts_and_chat_messages():
    text = W.TextPrompts(WordTokenizer())
    fixed = _build("fixed", text, num_requests=5, input_len=12, output_len=3)
    assert all(isinstance(r.prompt, str) and r.prompt_len == 12 for r in fixed)
    chat = _build("multi-turn", text, num_requests=6, input_len=4, output_len=2, turns=2,
                  conversations_in_flight=3)
    assert all(r.prompt is None and r.messages[-1]["role"] == "user" for r in chat)
    first, second = chat[0], chat[3]
    assert second.group == first.group
    assert second.messages[:2] == first.messages
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.flat_prompt().startswith(first.flat_prompt())


def test_workload_file_roundtrip(tmp_path):
    reqs = _build("shared-prefix", num_requests=5, input_len=20) + \
        _build("multi-turn", W.TextPrompts(WordTokenizer()), num_requests=3, input_len=4)
    W.save(reqs, tmp_path / "w.jsonl")
    assert W.load(tmp_path / "w.jsonl") == reqs
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no requests"):
        W.load(tmp_path / "empty.jsonl")


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="prefix_len"):
        W.WorkloadSpec(kind="shared-prefix", input_len=32, prefix_len=32)
    with pytest.raises(ValueError, match="input_min/input_max"):
        W.WorkloadSpec(kind="uniform", input_min=50, input_max=10)
    with pytest.raises(ValueError, match="kind"):
        W.WorkloadSpec(kind="zipf")
    with pytest.raises(ValueError, match="vocab_size"):
        W.TokenIdPrompts(vocab_size=5)


def test_arrival_times():
    poisson = W.arrival_times(10, 100, "poisson", seed=1)
    assert poisson == W.arrival_times(10, 100, "poisson", seed=1)
    assert 900 < len(poisson) < 1100 and poisson == sorted(poisson) and poisson[-1] < 100
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01
    assert W.arrival_times(4, 1, "constant") == [0, 0.25, 0.5, 0.75]
    with pytest.raises(ValueError):
        W.arrival_times(0, 10, "poisson")
    with pytest.raises(ValueError):
        W.arrival_times(1, 10, "bursty")


def _rec(i, ttft, gaps, error=None, tokens=None):
    n = len(gaps) + 1 if tokens is None else tokens
    return RequestRecord(index=i, protocol="HTTP", max_tokens=n, start=100.0 + i, ttft_s=ttft,
                         itl_s=list(gaps), e2e_s=ttft + sum(gaps), output_tokens=n, error=error)


def test_percentile_matches_linear_interpolation():
    xs = [random.Random(0).random() for _ in range(101)]
    import numpy as np
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_summary_and_slo():
    slo = Slo(ttft_ms=100, itl_ms=20)
    recs = [_rec(0, 0.05, [0.01] * 4), _rec(1, 0.2, [0.01] * 4),  # TTFT too slow
            _rec(2, 0.05, [0.01, 0.05, 0.01, 0.01]),  # one slow gap, mean 20 ms: meets
            _rec(3, 0.05, [0.03] * 4), _rec(4, 0.01, [], error="HTTP 500")]
    s = summarize(recs, slo)
    assert s["requests"] == 5 and s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["slo_fraction"] == pytest.approx(2 / 5)
    assert s["ttft_p50_ms"] == pytest.approx(50)
    assert s["itl_p99_ms"] == pytest.approx(percentile([g for r in recs[:4] for g in r.itl_s],
                                                       99) * 1e3)
    assert s["output_tokens"] == 20 and s["short_outputs"] == 0
    window = (104 + 0.01) - 100  # first send to the last answer, failed ones included
    assert s["output_tok_s"] == pytest.approx(20 / window)
    assert s["sent_rps"] is None
    timed = summarize(recs, slo, duration_s=10)  # the run's duration is the longer window
    assert timed["output_tok_s"] == pytest.approx(2.0) and timed["sent_rps"] == 0.5
    assert timed["achieved_rps"] == pytest.approx(0.4)


def test_slo_on_each_requests_own_inter_token_p99():
    # 100 gaps of 10 ms but two stalls of 100 ms: the mean (11.8 ms) holds a 20 ms TPOT bound,
    # the request's own p99 (~100 ms) breaks a 25 ms p99 bound; a steady stream holds both.
    stalled = _rec(0, 0.05, [0.01] * 98 + [0.1, 0.1])
    steady = _rec(1, 0.05, [0.012] * 100)
    loose, tight = Slo(ttft_ms=1000, itl_ms=20), Slo(ttft_ms=2000, itl_p99_ms=25)
    assert loose.met_by(stalled) and loose.met_by(steady)
    assert not tight.met_by(stalled) and tight.met_by(steady)
    assert not Slo(ttft_ms=1000, itl_ms=20, itl_p99_ms=25).met_by(stalled)
    assert Slo(ttft_ms=100).met_by(stalled) and not Slo(ttft_ms=10).met_by(stalled)  # TTFT only
    assert tight.describe() == "TTFT ≤ 2000 ms and the request's own inter-token p99 ≤ 25 ms"
    with pytest.raises(ValueError):
        Slo(ttft_ms=1000, itl_p99_ms=0)


def test_report_recomputes_a_run_under_the_inter_token_p99_slo(tmp_path):
    cfg = SweepConfig(layouts=["colo1"], rates=[1, 2], slo=Slo(ttft_ms=1000, itl_ms=20),
                      out=tmp_path)
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    for load, records in ((1, [_rec(0, 0.05, [0.012] * 100), _rec(1, 0.05, [0.012] * 100)]),
                          (2, [_rec(0, 0.05, [0.01] * 98 + [0.1, 0.1]),
                               _rec(1, 0.05, [0.012] * 100)])):
        folder = tmp_path / "colo1" / cfg.label(load)
        folder.mkdir(parents=True)
        (folder / "requests.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    report.main([str(tmp_path)])  # as saved: every request meets the TPOT bound
    assert [p["slo_fraction"] for p in json.loads(
        (tmp_path / "summary.json").read_text())["points"]] == [1.0, 1.0]
    report.main([str(tmp_path), "--slo-ttft-ms", "2000", "--slo-itl-ms", "off",
                 "--slo-itl-p99-ms", "25"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["slo_fraction"] for p in summary["points"]] == [1.0, 0.5]
    assert summary["goodput"][0]["goodput"] == 1
    assert "SLO: TTFT ≤ 2000 ms and the request's own inter-token p99 ≤ 25 ms" in \
        (tmp_path / "summary.md").read_text()


def test_goodput_is_the_highest_load_meeting_the_slo():
    assert goodput([(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5)], 0.9) == 4
    assert goodput([(1, 0.5), (2, 0.2)], 0.9) is None
    assert goodput([(1, 0.95), (2, 0.85), (4, 0.92)], 0.9) == 4
    assert goodput([], 0.9) is None
    with pytest.raises(ValueError):
        Slo(ttft_ms=0, itl_ms=10)


def test_layouts():
    assert parse_layout("colo") == parse_layout("colo1") == parse_layout("colocated1")
    colo = parse_layout("COLO4")
    assert (colo.name, colo.prefill, colo.decode, colo.colocated) == ("colo4", 0, 4, True)
    assert (parse_layout("2p3d").prefill, parse_layout("2p3d").decode) == (2, 3)
    for bad in ("0p1d", "1p0d", "colo0", "p1d", "2x2", ""):
        with pytest.raises(ValueError):
            parse_layout(bad)
    assert [x.name for x in auto_layouts(4, 1)] == ["colo4", "1p3d", "2p2d", "3p1d"]
    assert [x.name for x in auto_layouts(1, 0.5)] == ["colo2", "1p1d"]
    assert [x.name for x in auto_layouts(0, 0)] == ["colo1", "1p1d"]
    gpu = Resources(num_gpus=1, num_cpus=2)
    assert missing_resources(parse_layout("1p3d"), gpu, {"GPU": 4, "CPU": 64}) is None
    assert "needs 4 GPUs" in missing_resources(parse_layout("2p2d"), gpu, {"GPU": 2, "CPU": 64})


def test_layout_configs_validate():
    from deploy.config import BatonConfig

    gpu = Resources(num_gpus=1, num_cpus=4)
    cfg = BatonConfig(**parse_layout("1p3d").app_config({"model": "dummy:Qwen3-8B"}, gpu,
                                                        transfer={"backend": "auto"}))
    assert (cfg.mode, cfg.prefill.num_replicas, cfg.decode.num_replicas) == \
        ("disaggregated", 1, 3)
    assert cfg.prefill.num_gpus == cfg.decode.num_gpus == 1
    colo = BatonConfig(**parse_layout("colo2").app_config(ENGINE, Resources()))
    assert colo.mode == "colocated" and colo.decode.num_replicas == 2


def test_gpu_command_line(tmp_path):
    from loadtests.sweep import locust_command, parse_args

    cfg = parse_args(["--model", "dummy:Qwen3-8B", "--layouts", "colo2,1p1d",
                      "--gpus-per-replica", "1", "--rates", "4,1,2", "--duration", "60",
                      "--input-len", "2048", "--output-len", "256", "--slo-ttft-ms", "1000",
                      "--slo-itl-ms", "50", "--out", str(tmp_path)])
    assert cfg.loads() == [1, 2, 4] and cfg.resources.num_gpus == 1
    assert cfg.engine_config() == {"model": "dummy:Qwen3-8B"}  # sized from GPU memory
    cmd = locust_command(cfg, 2, "http://127.0.0.1:1", tmp_path / "w.jsonl", tmp_path)
    assert "OpenAIStreamUser" in cmd and cmd[cmd.index("--rate") + 1] == "2"
    assert cmd[cmd.index("-u") + 1] == "1"  # open loop: one sender, requests on greenlets
    closed = parse_args(["--users", "1,8", "--slo-ttft-ms", "1", "--slo-itl-ms", "1",
                         "--protocol", "grpc", "--out", str(tmp_path)])
    cmd = locust_command(closed, 8, "127.0.0.1:1", tmp_path / "w.jsonl", tmp_path)
    assert "GrpcStreamUser" in cmd and cmd[cmd.index("-u") + 1] == "8"
    assert cmd[cmd.index("--rate") + 1] == "0"


def test_processes_share_an_open_loop_load(tmp_path):
    """Each locust process sends rate/processes on a schedule of its own seed, from its own
    slice of the load's workload, and records to a file of its own; process 0 is the
    single-process sweep's command exactly."""
    from loadtests import workloads
    from loadtests.sweep import locust_command, parse_args, prepare_workloads

    argv = ["--model", "dummy:Qwen3-8B", "--rates", "8", "--duration", "10", "--input-len", "16",
            "--output-len", "4", "--slo-ttft-ms", "1", "--prompt-format", "ids"]
    one = parse_args(argv + ["--out", str(tmp_path / "one")])
    three = parse_args(argv + ["--out", str(tmp_path / "three"), "--processes", "3"])
    maker = workloads.prompt_maker("dummy:Qwen3-8B", "ids")
    [whole] = prepare_workloads(one, maker)[8]
    slices = prepare_workloads(three, maker)[8]
    assert len(slices) == 3
    sent = [workloads.load(path) for path in slices]
    for k, part in enumerate(sent):  # as many as that process's schedule sends
        assert len(part) == len(workloads.arrival_times(8 / 3, 10, "poisson",
                                                        three.sender_seed(8, k)))
    assert len(three.arrivals(8)) == sum(map(len, sent))  # what the planner replays
    assert one.arrivals(8) == workloads.arrival_times(8, 10, "poisson", one.seed_for(8))
    indexes = [r.index for part in sent for r in part]
    assert indexes == list(range(len(indexes)))
    cmd = locust_command(three, 8, "h", slices[1], tmp_path, process=1)
    assert float(cmd[cmd.index("--rate") + 1]) == 8 / 3  # exactly: the schedule is drawn from it
    assert cmd[cmd.index("--seed") + 1] == str(three.sender_seed(8, 1)) != str(one.seed_for(8))
    assert cmd[cmd.index("--records-file") + 1].endswith("requests.p1.jsonl")
    assert cmd[cmd.index("--csv") + 1].endswith("locust.p1")
    first = locust_command(one, 8, "h", whole, tmp_path)
    assert first[first.index("--seed") + 1] == str(one.seed_for(8))
    assert first[first.index("--records-file") + 1].endswith("requests.jsonl")
    with pytest.raises(SystemExit):
        parse_args(["--users", "4", "--processes", "2", "--slo-ttft-ms", "1"])


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "1p1d,4x4", "--rates", "1"], "layout '4x4'"),
    (["--rates", "1", "--users", "2"], "not allowed"),
    (["--rates", "0"], "rates must be > 0"),
    (["--rates", "1", "--workload", "shared-prefix", "--input-len", "8", "--prefix-len", "8"],
     "prefix_len"),
])
def test_bad_command_lines_are_refused(argv, message, capsys):
    from loadtests.sweep import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv + ["--slo-ttft-ms", "1", "--slo-itl-ms", "1"])
    assert message in capsys.readouterr().err


def _sweep(tmp_path, *args):
    from loadtests import sweep

    out = tmp_path / "run"
    code = sweep.main(["--model", "tiny", "--duration", "5", "--drain-timeout", "30",
                       "--input-len", "24", "--output-len", "8", "--slo-ttft-ms", "5000",
                       "--slo-itl-ms", "1000", "--engine", json.dumps(ENGINE),
                       "--request-timeout", "60", "--deploy-timeout", "180", "--out", str(out),
                       *args])
    return code, out


@pytest.fixture()
def bystander(ray_cluster):
    """Someone else's app on the cluster the sweep runs on; the sweep must leave it running."""
    from ray import serve

    from deploy.ray_env import driver_handle, free_port
    from tests.conftest import shutdown_serve

    @serve.deployment(ray_actor_options={"num_cpus": 0.05})
    class Bystander:
        def __call__(self, *args):
            return "still here"

    from tests.test_serving_e2e import GRPC_SERVICER
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                grpc_options={"port": free_port(), "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(Bystander.bind(), name="bystander", route_prefix="/bystander")

    def answers() -> bool:
        return driver_handle("Bystander", "bystander").remote().result(
            timeout_s=30) == "still here"

    assert answers()
    yield answers
    shutdown_serve()


def _only_the_sweeps_app_is_gone(bystander) -> bool:
    from ray import serve
    apps = serve.status().applications
    return "baton-sweep" not in apps and bystander()


def test_the_sweep_starts_its_own_ray_unless_told_to_join(monkeypatch):
    """Without --address the sweep never joins the Ray that `ray start` runs on this machine
    (whose apps its Serve calls would touch): ray.init(address="local") starts one of its own."""
    import ray

    from loadtests.sweep import ensure_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert ensure_ray(None, 4) is True  # started here: the sweep owns it
    assert ensure_ray("auto", None) is False  # joined: it owns only its app
    assert [c["address"] for c in calls] == ["local", "auto"]
    assert calls[0]["num_cpus"] == 4 and calls[1]["num_cpus"] is None


@pytest.mark.e2e
def test_short_cpu_sweep(bystander, tmp_path):
    code, out = _sweep(tmp_path, "--layouts", "colo1,1p1d", "--rates", "1,2")
    assert code == 0
    for layout in ("colo1", "1p1d"):
        for rate in ("rate_1", "rate_2"):
            run = out / layout / rate
            records = read_records(run / "requests.jsonl")
            assert len(records) >= 2
            for r in records:
                assert r.error is None, r.error
                assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s
                assert r.output_tokens == r.max_tokens == 8
                assert len(r.itl_s) == 7 and all(g >= 0 for g in r.itl_s)
                assert r.prompt_tokens > 0 and r.finish_reason == "length"
            rows = {row["Name"]: row for row in csv.DictReader(open(run / "locust_stats.csv"))}
            assert int(rows["E2E"]["Request Count"]) == len(records)
            assert int(rows["TTFT"]["Request Count"]) == len(records)
            assert int(rows["ITL"]["Request Count"]) == 7 * len(records)
            assert int(rows["Aggregated"]["Failure Count"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["points"]) == 4 and summary["failures"] == []
    assert all(p["errors"] == 0 and p["ttft_p50_ms"] > 0 and p["output_tok_s"] > 0
               for p in summary["points"])
    assert {g["layout"] for g in summary["goodput"]} == {"colo1", "1p1d"}
    text = (out / "summary.md").read_text()
    assert "## Goodput" in text and "| colo1 | 2 |" in text and "| 1p1d | 1 |" in text
    for plot in ("ttft.png", "itl_p99.png", "throughput.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(csv.DictReader(open(out / "summary.csv")))) == 4
    assert _only_the_sweeps_app_is_gone(bystander)
    report.main([str(out), "--slo-ttft-ms", "0.001"])  # the same records under a harder SLO
    rebuilt = json.loads((out / "summary.json").read_text())
    assert [(p["layout"], p["load"]) for p in rebuilt["points"]] == \
        [(p["layout"], p["load"]) for p in summary["points"]]
    assert all(p["slo_fraction"] == 0 for p in rebuilt["points"])
    assert all(g["goodput"] is None for g in rebuilt["goodput"])
    assert "none met" in (out / "summary.md").read_text()


@pytest.mark.e2e
def test_grpc_sweep_goes_on_after_a_layout_that_does_not_fit(bystander, tmp_path):
    # Two locust processes share the load; two ingress replicas serve it.
    code, out = _sweep(tmp_path, "--layouts", "4p4d,colo1", "--rates", "2", "--protocol",
                       "grpc", "--workload", "multi-turn", "--turns", "2", "--prompt-format",
                       "ids", "--duration", "3", "--processes", "2", "--router-replicas", "2")
    assert code == 1  # something failed
    summary = json.loads((out / "summary.json").read_text())
    assert [f["layout"] for f in summary["failures"]] == ["4p4d"]
    assert "needs 4.5 CPUs" in summary["failures"][0]["error"]
    [point] = summary["points"]
    assert point["layout"] == "colo1" and point["errors"] == 0 and point["short_outputs"] == 0
    app = json.loads((out / "colo1" / "app_config.json").read_text())
    assert app["router"]["num_replicas"] == 2
    records = read_records(out / "colo1" / "rate_2" / "requests.jsonl")
    sent = [line for k in (0, 1) for line in
            (out / "workloads" / f"rate_2.p{k}.jsonl").read_text().splitlines()]
    assert sorted(r.index for r in records) == sorted(json.loads(x)["index"] for x in sent)
    assert not list((out / "colo1" / "rate_2").glob("requests.p*.jsonl"))  # merged
    assert {r.protocol for r in records} == {"gRPC"}
    assert all(r.output_tokens == 8 and r.ttft_s > 0 for r in records)
    assert "4p4d (whole layout)" in (out / "summary.md").read_text()
    assert _only_the_sweeps_app_is_gone(bystander)
