"""engine_bench's timing points for speculative decoding, on the CPU: the forced verification
(``forced``/``kept70``) called as the engine calls ``verify``, keeping its share of the
proposals; and the engine the profiler's tools build from their options."""

import pytest

from engine import LLM, SamplingParams
from tests.models import random_prompts


@pytest.mark.parametrize("percent", [100, 70])
def test_forced_verification_keeps_its_share_inside_the_engine(monkeypatch, percent):
    import engine.llm_engine as llm_engine
    from benchmarks.engine_bench import _forcing
    from engine.spec_decode import SpecController

    llm = LLM("tiny", show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.spec = SpecController(min_acceptance=0.0, empty_steps=10**9, min_gain=None,
                                     start_on=True)
    llm.engine.propose = lambda seq, limit: [seq.token_ids[-1]] * min(limit, 4)
    monkeypatch.setattr(llm_engine, "verify", _forcing(percent))
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    outs = llm.generate(random_prompts([20, 30], seed=1), params)
    assert all(len(o.token_ids) == 41 for o in outs)
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens == pytest.approx(percent / 100,
                                                                               abs=0.05)


def test_the_pieces_of_a_step_are_timed_in_place_and_put_back():
    """``profiler decode``'s in-place timers: every piece of ``engine.step()`` that ran is
    counted once a step, the tokens are those of an untimed run, and every wrapped function is
    the original again afterwards."""
    from benchmarks.profiler import timed_pieces
    from engine.sampler import Sampler

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = random_prompts([20], seed=2)
    want = LLM("tiny", show_progress=False).generate(prompt, params)[0].token_ids
    engine, sample = LLM("tiny", show_progress=False).engine, Sampler.__call__
    engine.add_request(prompt[0], params)
    outputs = []
    pieces = timed_pieces(engine, 20, outputs)
    assert Sampler.__call__ is sample and not {"step", "_launch"} & set(vars(engine))
    assert pieces["engine.step"][1] == pieces["schedule"][1] == pieces["sample"][1] == 1
    assert pieces["engine.step"][0] >= pieces["launch"][0] > 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == want


def test_serving_bench_stub_forward_runs_the_engine_without_its_model(monkeypatch):
    """``serving_bench --stub-forward`` replaces the runner's forward with fixed logits: an
    engine so patched still schedules, samples and finishes requests (it broke once when the
    forward's signature grew and the stub's did not)."""
    from benchmarks.serving_bench import stub_forward
    from engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_forward", ModelRunner._forward)  # put back afterwards
    stub_forward()
    llm = LLM("tiny", show_progress=False)
    calls = []
    monkeypatch.setattr(type(llm.engine.model), "forward",
                        lambda *a, **k: calls.append(1))  # never called
    outs = llm.generate(random_prompts([12, 30], seed=3),
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6] and not calls


def test_serving_bench_hops_split_the_way_in_and_time_an_early_start_s_claim():
    """The zero-load hops: the way to the ingress split at its HTTP app's door, and an early
    start's claim timed from the start; a gRPC request (no door) and a request started by its
    call (no claim) leave those parts out."""
    from benchmarks.serving_bench import breakdown

    decode = {"received": 10.0, "claimed": 10.002, "queued": 10.001, "first_token": 10.008,
              "prefill_called": 0.0}
    http = {"sent": 9.990, "first": 10.010, "timing": {
        "router": {"arrived": 9.991, "received": 9.992, "submitted": 9.9925,
                   "first_token": 10.009}, "decode": decode}}
    grpc = {"sent": 9.990, "first": 10.010, "timing": {
        "router": {"arrived": 0.0, "received": 9.992, "submitted": 9.9925, "first_token": 10.009},
        "decode": dict(decode, claimed=0.0)}}
    hops = breakdown([http])
    assert hops["client -> ingress"] == pytest.approx(2.0)
    assert hops["(of which) client -> ingress app"] == pytest.approx(1.0)
    assert hops["(of which) ingress: parse, check"] == pytest.approx(1.0)
    assert hops["(early start) -> its Serve call"] == pytest.approx(2.0)
    assert hops["engine: to first token"] == pytest.approx(7.0)
    plain = breakdown([grpc])
    assert "(of which) client -> ingress app" not in plain
    assert "(early start) -> its Serve call" not in plain
    assert plain["client -> ingress"] == pytest.approx(2.0)


def test_serving_bench_hops_of_a_hand_over_follow_its_first_token():
    """A hand-over whose first token came ahead of its KV: the hops to the first token end at
    its publication, and the push and the answer are counted after it; one whose first token
    came with the admission keeps the call's hops (the push and the answer before it)."""
    from benchmarks.serving_bench import breakdown

    prefill = {"received": 10.003, "prefilled": 10.005, "pushed": 10.006}
    decode = {"received": 10.0, "prefill_called": 10.001, "prefill_returned": 10.0065,
              "queued": 10.0066, "first_token": 10.0052, "prefill": prefill}

    def record(d):
        return {"sent": 9.990, "first": 10.010, "timing": {
            "router": {"received": 9.992, "submitted": 9.9925, "first_token": 10.009},
            "decode": d}}

    ahead = breakdown([record(decode)])
    assert ahead["decode: reserve, lease"] == pytest.approx(1.0)
    assert ahead["hand-over to the first token"] == pytest.approx(4.2)
    assert ahead["(of which) early start or call -> prefill"] == pytest.approx(2.0)
    assert ahead["(of which) first token -> decode, published"] == pytest.approx(0.2)
    assert ahead["(after it) prefill: push"] == pytest.approx(1.0)
    assert ahead["(after it) answer -> decode"] == pytest.approx(0.5)
    assert "prefill call (prefill + push)" not in ahead and "decode: land, admit" not in ahead
    late = breakdown([record(dict(decode, first_token=10.007))])
    assert late["prefill call (prefill + push)"] == pytest.approx(5.5)
    assert late["(of which) prefill: push"] == pytest.approx(1.0)
    assert late["decode: land, admit"] == pytest.approx(0.5)
    assert "hand-over to the first token" not in late
    # The engine threads' stamps, where the prefill replica published the token itself: the
    # prefill's part splits at its engine, and the token's way ends where the decode has it.
    stamped = breakdown([record(dict(decode, reserved=10.0004, first_arrived=10.0047,
                                     prefill=dict(prefill, added=10.0032, sampled=10.0045)))])
    assert stamped["(of which) to the engine, reserve"] == pytest.approx(0.4)
    assert stamped["(of which) back to the loop, send"] == pytest.approx(0.6)
    assert stamped["(of which) prefill: to its engine"] == pytest.approx(0.2)
    assert stamped["(of which) prefill: engine to the first token"] == pytest.approx(1.3)
    assert stamped["(of which) first token -> decode"] == pytest.approx(0.2)
    assert stamped["(of which) decode: publish it"] == pytest.approx(0.5)
    assert "(of which) prefill: queue, compute" not in stamped
    # Sent ahead of its reservation: the reservation is beside the hand-over, not before it.
    ahead = breakdown([record(dict(decode, reserved=10.0015))])
    assert ahead["decode: to the hand-over's send"] == pytest.approx(1.0)
    assert ahead["(beside it) to the engine, reserve"] == pytest.approx(1.5)
    assert "decode: reserve, lease" not in ahead


def test_served_engine_options_reach_the_served_engines_alone():
    """``serving_bench --served-engine-option``: the served engines take the field over the
    offline reference's, which keeps its own (the served tokens with speculation against the
    offline ones without)."""
    from benchmarks.serving_bench import served_config

    offline = {"model": "tiny", "dtype": "float32"}
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    served = served_config(offline, [f"speculative_config={spec}", 'dtype="bfloat16"'])
    assert served == {"model": "tiny", "dtype": "bfloat16",
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}
    assert offline == {"model": "tiny", "dtype": "float32"}
    assert served_config(offline, []) == offline


def test_serving_bench_sampling_flags_make_one_set_of_fields_for_every_path():
    """``serving_bench --temperature --top-k --top-p``: the fields every request carries, as
    the offline engine's ``SamplingParams``, the HTTP body and gRPC's ``GenerateRequest`` take
    them; unset flags send the engine's defaults (greedy by default), never nothing: an unset
    field would take a served model's generation config."""
    from argparse import Namespace

    from benchmarks.serving_bench import sampling_of
    from proto import baton_pb2

    qwen3 = sampling_of(Namespace(temperature=0.6, top_k=20, top_p=0.95))
    assert qwen3 == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    plain = sampling_of(Namespace(temperature=0.0, top_k=-1, top_p=1.0))
    assert plain == {"temperature": 0.0, "top_k": -1, "top_p": 1.0}
    assert SamplingParams(**plain) == SamplingParams(temperature=0.0)
    params = SamplingParams(**qwen3)
    assert (params.top_k, params.top_p, params.greedy) == (20, 0.95, False)
    req = baton_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=4, **qwen3)
    assert (req.top_k, round(req.top_p, 6), round(req.temperature, 6)) == (20, 0.95, 0.6)


@pytest.mark.parametrize("flags,wanted", [([], {}), (["--fp8-lm-head"], {"fp8_lm_head": True}),
                                          (["--quantization", "fp8", "--fp8-lm-head"],
                                           {"quantization": "fp8", "fp8_lm_head": True})])
def test_profiler_timeline_builds_the_engine_it_is_asked_for(monkeypatch, flags, wanted):
    """``profiler timeline``'s engine options (the timeline itself needs a GPU): the engine is
    built with the quantization and the FP8 head asked for, and nothing else."""
    import benchmarks.engine_bench as engine_bench
    from benchmarks.profiler import timeline_main

    class Built(Exception):
        pass

    def engine(model, **kw):
        raise Built(model, kw)

    monkeypatch.setattr(engine_bench, "_engine", engine)
    with pytest.raises(Built) as built:
        timeline_main(["--model", "tiny", *flags])
    assert built.value.args == ("tiny", {"max_num_seqs": 8, **wanted})


def test_profiler_ttft_gaps_take_turns_and_report_every_variant(monkeypatch, capsys):
    """``profiler ttft --gaps``: each variant's requests interleave with the others' (one
    request a variant in turn, each after its own idle), every variant reports its median, and
    ``--profile-gap`` names the host operations of a request, back to back and apart."""
    import benchmarks.profiler as profiler

    seen = []
    idle = profiler.idle
    monkeypatch.setattr(profiler, "idle", lambda kind, gap_s: (seen.append((kind, gap_s)),
                                                               idle(kind, gap_s)))
    profiler.ttft_main(["--model", "tiny", "--n", "3", "--gaps", "sleep:0", "spin:2", "both:1",
                        "--gaps-only", "--profile-gap", "1"])
    out = capsys.readouterr().out
    # before them: the warm-up (4), back to back (3) and 20 ms apart (3); after them, the
    # profile's four rounds of 12
    assert seen[10:19] == [("sleep", 0.0), ("spin", 0.002), ("both", 0.001)] * 3
    assert seen[19:] == [("sleep", gap) for gap in (0.0, 0.001, 0.0, 0.001) for _ in range(12)]
    for variant in ("sleep:0", "spin:2", "both:1"):
        assert f"direct, {variant:9s} before: median" in out
    assert "host time a request (us), back to back / 1 ms apart" in out
    assert "aten::" in out
