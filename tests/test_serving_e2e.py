"""The app on local Ray with the tiny model: HTTP answers carry the offline engine's greedy
tokens, disaggregated (NIXL over host memory) and colocated alike, the decode role speculating
(a draft model) and the offline engine not; bad input is a 400; a cancelled stream leaves no KV
block held."""

import json
import re
import time

import pytest
import requests
import torch

from deploy.ray_env import driver_handle, free_port
from engine import LLM, SamplingParams
from tests.conftest import serve_log_dir, shutdown_serve
from tests.models import random_prompts

pytestmark = pytest.mark.e2e
# speculative decoding as shipped (the first decode step of a batch always looks): the tokens
# must be the offline engine's without it
ENGINE = {"model": "tiny", "num_blocks": 256, "max_num_seqs": 16,
          "speculative_config": {"method": "draft_model", "model": "tiny",
                                 "num_speculative_tokens": 3}}
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
GRPC_SERVICER = "proto.servicer.add_to_server"
PROMPTS = ["The quick brown fox", "Hello world! Hello there, how are you today?", "a"]
PROMPTS_IDS = random_prompts([24], vocab=512, seed=55)[0]


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny")


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def server(request, ray_cluster):
    from ray import serve

    from deploy.app import build_app

    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    # on a GPU host (``pytest tests/test_serving_e2e.py`` there), both roles share the GPU
    roles = {r: {"num_gpus": 0.4} for r in ("prefill", "decode")} \
        if torch.cuda.is_available() else {}
    serve.run(build_app({"mode": request.param, "engine": ENGINE,
                         "router": {"request_timeout_s": 60},
                         "disaggregation": {"mode": "always"},  # the hand-over under test
                         **roles}),
              name="baton", route_prefix="/")
    yield request.param, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    shutdown_serve()


def _post(url, body, **kw):
    return requests.post(url, json=body, timeout=60, **kw)


def _events(resp):
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            yield None if payload == b"[DONE]" else json.loads(payload)


def test_completions_match_offline_engine(server, offline):
    _, url, _ = server
    expected = offline.generate(PROMPTS, SamplingParams(**GREEDY))
    for prompt, want in zip(PROMPTS, expected):
        body = _post(f"{url}/v1/completions", {"prompt": prompt, **GREEDY}).json()
        choice = body["choices"][0]
        assert choice["token_ids"] == want.token_ids
        assert choice["text"] == want.text
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 12
    ids = random_prompts([40], vocab=512, seed=51)[0]
    body = _post(f"{url}/v1/completions", {"prompt": ids, **GREEDY}).json()
    assert body["choices"][0]["token_ids"] == offline.generate([ids], SamplingParams(**GREEDY))[0].token_ids


def test_requests_start_on_the_decode_replica_ahead_of_their_calls(server, offline):
    """Once a first request has opened the decode replica's token channel, the ingress sends
    each request over it as Serve's call leaves (``router.early_start``); the call claims the
    running request: the offline engine's tokens, nothing dropped, no block left held. (A call
    that overtakes its early start runs as before, so the count is at least one, not exact.)"""
    _, url, _ = server
    early = driver_handle("DecodeServer").early_starts
    _post(f"{url}/v1/completions", {"prompt": PROMPTS[2], **GREEDY})  # opens the channel
    before = early.remote().result(timeout_s=30)
    expected = offline.generate(PROMPTS, SamplingParams(**GREEDY))
    for prompt, want in zip(PROMPTS, expected):
        body = _post(f"{url}/v1/completions", {"prompt": prompt, **GREEDY}).json()
        assert body["choices"][0]["token_ids"] == want.token_ids
    after = early.remote().result(timeout_s=30)
    assert after["claimed"] > before["claimed"] and after["dropped"] == before["dropped"]
    _wait_idle(url)


def test_hand_overs_start_on_the_prefill_replica_ahead_of_their_calls(server, offline):
    """Disaggregated: once a first hand-over has had the prefill replica dial the decode
    replica's own sink, each hand-over is sent over it ahead of its Serve call (and of the
    decode replica's reservation) and claimed by that call, and its first token reaches the
    client ahead of its KV's landing: the offline engine's tokens, nothing dropped, no block
    left held."""
    mode, url, _ = server
    if mode != "disaggregated":
        pytest.skip("colocated: nothing is handed over")
    early = driver_handle("PrefillServer").early_starts
    _post(f"{url}/v1/completions", {"prompt": PROMPTS[2], **GREEDY})  # the prefill replica dials
    before = early.remote().result(timeout_s=30)
    expected = offline.generate(PROMPTS, SamplingParams(**GREEDY))
    ahead = before_reserving = 0
    for prompt, want in zip(PROMPTS, expected):
        body = _post(f"{url}/v1/completions", {"prompt": prompt, **GREEDY,
                                               "include_timing": True}).json()
        assert body["choices"][0]["token_ids"] == want.token_ids
        decode = body["usage"]["timing"]["decode"]
        ahead += decode["first_token"] < decode["queued"]  # published before the KV landed
        # ``always``: sent while the decode replica's engine reserved the blocks
        before_reserving += decode["prefill_called"] < decode["reserved"]
    after = early.remote().result(timeout_s=30)
    assert after["claimed"] > before["claimed"] and after["dropped"] == before["dropped"]
    assert ahead > 0 and before_reserving > 0
    _wait_idle(url)


def _usage(stream: bool) -> dict:
    """A usage chunk at the end of a stream, which OpenAI (and vLLM) send only when asked."""
    return {"stream_options": {"include_usage": True}} if stream else {}


def test_streaming_matches_and_ends_with_usage(server, offline):
    _, url, _ = server
    want = offline.generate(PROMPTS[1], SamplingParams(**GREEDY))[0]
    plain = list(_events(_post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "stream": True,
                                                         **GREEDY}, stream=True)))
    assert all(e is None or e["choices"] for e in plain)  # no usage chunk unless asked
    resp = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "stream": True, **GREEDY,
                                           **_usage(True)}, stream=True)
    events = list(_events(resp))
    assert events[-1] is None  # [DONE]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_in_a_stream_is_never_sent(server, offline):
    _, url, _ = server
    full = offline.generate(PROMPTS[0], SamplingParams(**GREEDY))[0].text
    stop = full[4:7]
    resp = _post(f"{url}/v1/completions", {"prompt": PROMPTS[0], "stream": True, "stop": [stop],
                                           **GREEDY}, stream=True)
    text = "".join(e["choices"][0]["text"] for e in _events(resp) if e and e["choices"])
    assert text == full[: full.find(stop)]


def _decode_engine_tokens() -> int:
    """Output tokens the decode replica's engine has made so far (its step counters)."""
    return driver_handle("DecodeServer").engine_stats.remote().result(timeout_s=30)["output_tokens"]


def _decode_kv() -> dict:
    """The decode replica's own KV use (the ingress reports only what it sees)."""
    return driver_handle("DecodeServer").kv_load.remote().result(timeout_s=30)


def _wait_idle(url) -> None:
    deadline = time.time() + 30
    while time.time() < deadline and (_decode_kv()["used_blocks"] or
                                      _decode_kv()["held_blocks"]):
        time.sleep(0.2)
    load = _decode_kv()
    assert load["used_blocks"] == 0 and load["held_blocks"] == 0


def test_stop_string_aborts_the_request_in_the_engine(server, offline):
    """The engine stops on ids only; the ingress that finds the stop string cancels the call,
    and the decode replica aborts the request: it stops making tokens and frees its blocks."""
    _, url, _ = server
    params = {"temperature": 0, "ignore_eos": True, "max_tokens": 1500}
    full = offline.generate(PROMPTS[1], SamplingParams(**{**params, "max_tokens": 20}))[0]
    stop = full.text[5:8]
    want = offline.generate(PROMPTS[1], SamplingParams(**params, stop=[stop]))[0]
    before = _decode_engine_tokens()
    body = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "stop": [stop], **params}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == want.text
    assert choice["token_ids"] == want.token_ids and len(want.token_ids) < 20
    _wait_idle(url)
    made = _decode_engine_tokens() - before
    assert made < 100, f"the engine made {made} tokens for a request stopped after a few"


def test_chat_uses_the_template(server, offline):
    _, url, _ = server
    messages = [{"role": "user", "content": "What is two plus two?"}]
    ids = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = offline.generate([list(ids)], SamplingParams(**GREEDY))[0]
    body = _post(f"{url}/v1/chat/completions", {"messages": messages, **GREEDY}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert body["choices"][0]["token_ids"] == want.token_ids
    resp = _post(f"{url}/v1/chat/completions", {"messages": messages, "stream": True, **GREEDY},
                 stream=True)
    deltas = [e["choices"][0]["delta"] for e in _events(resp) if e and e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == want.text


def _openai(url):
    from openai import OpenAI
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_official_openai_client(server, offline):
    """Everyday calls of the `openai` package: models, completions and chat (whole and
    streamed) with the offline engine's text; `max_completion_tokens`, content parts, the
    developer role and the fields clients send for their own bookkeeping."""
    import openai

    _, url, _ = server
    client = _openai(url)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    want = offline.generate([PROMPTS[1]], SamplingParams(**GREEDY))[0]
    extra = {"ignore_eos": True}
    got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12,
                                    temperature=0, extra_body=extra)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 12
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12,
                                         temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text

    plain = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is two plus two?"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is two "},
                                          {"type": "text", "text": "plus two?"}]}]
    first = client.chat.completions.create(model="tiny", messages=plain, max_tokens=5,
                                           temperature=0, extra_body=extra)
    second = client.chat.completions.create(
        model="tiny", messages=parts, max_completion_tokens=5, temperature=0, user="u-1",
        metadata={"team": "a"}, store=False, extra_body=extra)
    assert second.usage.completion_tokens == 5
    assert second.choices[0].message.content == first.choices[0].message.content
    chunks = client.chat.completions.create(model="tiny", messages=parts, temperature=0,
                                            max_completion_tokens=5, stream=True,
                                            extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        first.choices[0].message.content

    many = client.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[1]],
                                     max_tokens=12, temperature=0, extra_body=extra)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[1].text == want.text

    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


SAMPLED = [
    dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=0, repetition_penalty=1.6, logit_bias={"17": 4.0, "100": -100}),
    dict(temperature=0.9, seed=41, min_p=0.1, frequency_penalty=-0.5, min_tokens=8),
]


@pytest.mark.parametrize("fields", SAMPLED, ids=["penalties", "repetition+bias", "seeded"])
def test_sampling_fields_give_the_offline_engines_tokens(server, offline, fields):
    """Penalties, logit_bias, min_p and min_tokens served as the offline engine runs them
    (test_logits_processing checks the engine against a written-out reference), whole and
    streamed: in disaggregated serving the prefill replica samples the first token with them."""
    _, url, _ = server
    prompt = PROMPTS_IDS[:18]
    want = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True,
                                                     **fields))[0]
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, **fields}
    whole = _post(f"{url}/v1/completions", body).json()
    assert whole["choices"][0]["token_ids"] == want.token_ids, whole
    streamed = _post(f"{url}/v1/completions", {**body, "stream": True}, stream=True)
    assert [t for e in _events(streamed) if e and e["choices"]
            for t in e["choices"][0]["token_ids"]] == want.token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_equal_n_single_requests(server, offline, stream):
    """n seeded sequences per prompt, a batch of two prompts: choice p·n + i has the tokens of
    a single request with seed + i (as vLLM seeds them); usage counts each prompt once."""
    _, url, _ = server
    prompts = PROMPTS[:2]
    sampled = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    want = offline.generate(prompts, SamplingParams(n=3, **sampled))
    resp = _post(f"{url}/v1/completions", {"prompt": prompts, "n": 3, "stream": stream,
                                           **sampled, **_usage(stream)}, stream=stream)
    assert resp.status_code == 200, resp.text
    if stream:
        events = [e for e in _events(resp) if e is not None]
        tokens = {}
        for e in events[:-1]:
            tokens.setdefault(e["choices"][0]["index"], []).extend(e["choices"][0]["token_ids"])
        usage = events[-1]["usage"]
    else:
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == list(range(6))
        tokens = {c["index"]: c["token_ids"] for c in body["choices"]}
        usage = body["usage"]
    assert [tokens[i] for i in range(6)] == [c.token_ids for group in want for c in group]
    assert len({tuple(t) for t in tokens.values()}) > 1
    n_prompt = sum(len(offline.engine.tokenize(p)) for p in prompts)
    assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 48
    chat = _post(f"{url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "n": 2, **sampled}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["token_ids"] != chat["choices"][1]["token_ids"]


def test_best_of_returns_the_most_likely_of_its_sequences(server, offline):
    _, url, _ = server
    sampled = dict(temperature=1.3, seed=3, max_tokens=6, ignore_eos=True)
    want = offline.generate([PROMPTS[1]], SamplingParams(n=2, best_of=4, **sampled))[0]
    body = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "n": 2, "best_of": 4,
                                           **sampled}).json()
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in want]
    assert all(c["logprobs"] is None for c in body["choices"])  # ranked by them, not asked
    assert body["usage"]["completion_tokens"] == 24  # every sequence ran


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_objects_as_openai_shapes_them(server, offline, stream):
    _, url, _ = server
    want = offline.generate([PROMPTS[1]], SamplingParams(logprobs=3, **GREEDY))[0]
    tok = offline.tokenizer

    def collect(resp, chat):
        if not stream:
            c = resp.json()["choices"][0]
            return c["logprobs"]["content"] if chat else c["logprobs"], c
        parts = [e["choices"][0] for e in _events(resp) if e and e["choices"]
                 and e["choices"][0]["logprobs"]]
        if chat:
            return [x for p in parts for x in p["logprobs"]["content"]], None
        merged = {k: [v for p in parts for v in p["logprobs"][k]] for k in
                  ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        return merged, None

    lp, _ = collect(_post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "logprobs": 3,
                                                   "echo": False, "stream": stream, **GREEDY},
                          stream=stream), chat=False)
    assert lp["tokens"] == [tok.decode([t]) for t in want.token_ids]
    assert lp["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
    assert [list(d) for d in lp["top_logprobs"]] == \
        [list(dict.fromkeys(tok.decode([t]) for t, _ in top)) for top in want.top_logprobs]
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]
    content, _ = collect(_post(f"{url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2,
        "stream": stream, **GREEDY}, stream=stream), chat=True)
    assert len(content) == 12
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])  # greedy


def test_the_official_openai_client_sampling_options(server, offline):
    """What the `openai` package sends for n, logprobs, penalties, logit_bias and seed."""
    _, url, _ = server
    client = _openai(url)
    messages = [{"role": "user", "content": "Count to three."}]
    got = client.chat.completions.create(
        model="tiny", messages=messages, n=2, max_completion_tokens=6, temperature=0.8, seed=5,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"17": 5}, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True, "min_p": 0.05})
    assert [c.index for c in got.choices] == [0, 1]
    for choice in got.choices:
        assert len(choice.logprobs.content) == 6
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    cmpl = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, n=2,
                                     best_of=3, logprobs=2, temperature=0.7, seed=11,
                                     extra_body={"ignore_eos": True})
    assert len(cmpl.choices) == 2 and len(cmpl.choices[0].logprobs.tokens) == 6
    assert all(len(d) <= 2 for d in cmpl.choices[0].logprobs.top_logprobs)


STRUCTURED = [
    ({"guided_choice": ["yes", "no", "maybe so"]}, {"kind": "choice",
                                                   "spec": '["yes", "no", "maybe so"]'}),
    ({"guided_regex": r"[a-c]{3}-\d{2}"}, {"kind": "regex", "spec": r"[a-c]{3}-\d{2}"}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "flag", "strict": True, "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"], "additionalProperties": False}}}},
     {"kind": "json_schema", "spec": json.dumps({"additionalProperties": False, "properties": {
         "ok": {"type": "boolean"}}, "required": ["ok"], "type": "object"}, sort_keys=True)}),
    ({"structured_outputs": {"grammar": 'root ::= "(" [0-9]+ ")" | "none"'}},
     {"kind": "grammar", "spec": 'root ::= "(" [0-9]+ ")" | "none"'}),
]


@pytest.mark.parametrize("fields, so", STRUCTURED, ids=["choice", "regex", "schema", "grammar"])
def test_structured_outputs_give_the_offline_engines_tokens(server, offline, fields, so):
    """Seeded sampling under a grammar, completions and chat: the offline engine's tokens (in
    disaggregated mode the prefill replica's first token is masked too)."""
    from engine.structured import StructuredOutput
    _, url, _ = server
    sampled = dict(temperature=1.0, seed=13, max_tokens=60)
    want = offline.generate([PROMPTS[0]], SamplingParams(
        structured_output=StructuredOutput(**so), **sampled))[0]
    got = _post(f"{url}/v1/completions", {"prompt": PROMPTS[0], **sampled, **fields}).json()
    assert got["choices"][0]["token_ids"] == want.token_ids, got
    assert got["choices"][0]["text"] == want.text
    streamed = _post(f"{url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Answer."}], "stream": True, **sampled,
        **fields}, stream=True)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in _events(streamed)
                   if e and e["choices"])
    if so["kind"] == "choice":
        assert text in ("yes", "no", "maybe so")


@pytest.mark.parametrize("body, fragment", [
    ({"guided_regex": "(ab"}, "guided_regex: Regex parsing error"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "give one structured output"),
])
def test_bad_structured_outputs_are_a_400(server, body, fragment):
    _, url, _ = server
    resp = _post(f"{url}/v1/completions", {"prompt": "hi", **body})
    assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], resp.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(url, body, stream=False):
    """(message, finish_reason) of a chat answer; streamed, the deltas folded into one."""
    resp = _post(f"{url}/v1/chat/completions", {"messages": ASK, "max_tokens": 120,
                                                **body, "stream": stream}, stream=stream)
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    message, reason = {"content": ""}, None
    for e in _events(resp):
        if not e or not e["choices"]:
            continue
        delta, reason = e["choices"][0]["delta"], e["choices"][0]["finish_reason"] or reason
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                message[key] = message.get(key, "") + delta[key]
        for c in delta.get("tool_calls") or ():  # OpenAI's streamed calls, joined by index
            calls = message.setdefault("tool_calls", [])
            while len(calls) <= c["index"]:
                calls.append({"function": {"name": "", "arguments": ""}, "deltas": 0})
            call = calls[c["index"]]
            call.update({k: c[k] for k in ("id", "type") if k in c})
            call["deltas"] += 1
            for key in ("name", "arguments"):
                call["function"][key] += c["function"].get(key) or ""
    for call in message.get("tool_calls", ()):
        assert call.pop("deltas") >= 2  # the name first, the arguments after it
    return message, reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_forced_by_tool_choice_round_trip(server, stream):
    """tool_choice required / a named function: the output is calls by grammar, parsed into
    OpenAI's tool_calls (finish_reason tool_calls); the conversation goes on with the call and a
    tool result."""
    _, url, _ = server
    sampled = dict(temperature=1.0, seed=2, tools=[WEATHER, NOW])
    message, reason = _chat(url, {**sampled, "tool_choice": "required",
                                  "parallel_tool_calls": False}, stream)
    assert reason == "tool_calls" and len(message["tool_calls"]) == 1, message
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in ("get_weather", "now")
        assert set(args) == ({"city"} if call["function"]["name"] == "get_weather" else set())
    named, reason = _chat(url, {**sampled, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, stream)
    assert [c["function"]["name"] for c in named["tool_calls"]] == ["get_weather"]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": named["tool_calls"]},
                    {"role": "tool", "tool_call_id": named["tool_calls"][0]["id"],
                     "content": "sunny, 21 C"}]
    resp = _post(f"{url}/v1/chat/completions", {"messages": follow, "max_tokens": 4,
                                                "tools": [WEATHER], "temperature": 0})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_auto_tool_calls_are_parsed_from_the_text(server, stream):
    """The random model is made to write Qwen3's markup (a one-option guided_choice): the
    reasoning comes back apart, a <tool_call> as tool_calls, with tool_choice auto."""
    _, url, _ = server
    text = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    message, reason = _chat(url, {"temperature": 0, "guided_choice": [text],
                                  "tools": [WEATHER]}, stream)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    assert reason == "tool_calls"
    # Without tools the call stays text; reasoning is split all the same.
    plain, reason = _chat(url, {"temperature": 0, "guided_choice": [text]}, stream)
    assert plain["reasoning_content"] == "The user wants weather." and "tool_calls" not in plain
    assert plain["content"].startswith("Let me check.\n<tool_call>") and reason == "stop"


def test_the_thinking_switch_reaches_the_template(server, offline):
    _, url, _ = server
    tok = offline.tokenizer
    for flag in (True, False):
        body = _post(f"{url}/v1/chat/completions", {
            "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": flag},
            "temperature": 0}).json()
        want = tok.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=flag,
                                       tokenize=False)
        assert body["usage"]["prompt_tokens"] == len(tok.encode(want, add_special_tokens=False))
    assert "<think>" in tok.apply_chat_template(ASK, add_generation_prompt=True,
                                                enable_thinking=False, tokenize=False)


def test_the_official_openai_client_tools(server):
    _, url, _ = server
    client = _openai(url)
    got = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0.9, seed=4, parallel_tool_calls=False)
    call = got.choices[0].message.tool_calls[0]
    assert got.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    again = client.chat.completions.create(
        model="tiny", max_tokens=3, tools=[WEATHER], messages=[
            *ASK, got.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert again.choices[0].message.role == "assistant"
    thought = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=40, temperature=0,
        extra_body={"guided_choice": ["<think>\nhmm\n</think>\n\nok"]})
    assert thought.choices[0].message.content == "ok"
    assert thought.choices[0].message.model_extra["reasoning_content"] == "hmm"


@pytest.mark.parametrize("body, fragment", [
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "no tool named 'x'"),
    ({"tools": [WEATHER, WEATHER]}, "two functions have one name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "frob"}}}], "tool_choice": "required"}, "tools: "),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "cannot be combined with a structured output"),
    ({"messages": [{"role": "user"}]}, "needs content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
])
def test_bad_tool_requests_are_a_400(server, body, fragment):
    _, url, _ = server
    resp = _post(f"{url}/v1/chat/completions", {"messages": ASK, **body})
    assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_gets_one_choice_each_in_order(server, offline, stream):
    _, url, _ = server
    batch = PROMPTS  # texts; a batch of token-id lists is the same path
    want = offline.generate(batch, SamplingParams(**GREEDY))
    resp = _post(f"{url}/v1/completions", {"prompt": batch, "stream": stream, **GREEDY,
                                           **_usage(stream)}, stream=stream)
    assert resp.status_code == 200, resp.text
    if stream:
        events = [e for e in _events(resp) if e is not None]
        tokens, text = {}, {}
        for e in events[:-1]:
            c = e["choices"][0]
            tokens.setdefault(c["index"], []).extend(c["token_ids"])
            text[c["index"]] = text.get(c["index"], "") + c["text"]
        usage = events[-1]["usage"]
    else:
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        tokens = {c["index"]: c["token_ids"] for c in body["choices"]}
        text = {c["index"]: c["text"] for c in body["choices"]}
        usage = body["usage"]
    for i, w in enumerate(want):
        assert tokens[i] == w.token_ids and text[i] == w.text
    assert usage["completion_tokens"] == 36 and len(usage["kv_transfer"]) == 3
    bad = _post(f"{url}/v1/completions", {"prompt": ["fine", ""], **GREEDY})
    assert bad.status_code == 400 and "must not be empty" in bad.json()["error"]["message"]
    t0 = time.perf_counter()  # more sequences than one request may run: refused at once
    wide = _post(f"{url}/v1/completions", {"prompt": ["x"] * 128, "n": 3, "max_tokens": 1})
    assert wide.status_code == 400 and time.perf_counter() - t0 < 5
    assert "128 prompts x 3 sequences exceed this server's 256 sequences per request" in wide.text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_completion(server, offline, stream):
    _, url, _ = server
    want = offline.generate([PROMPTS[1]], SamplingParams(**GREEDY))[0].text
    resp = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "echo": True, "stream": stream,
                                           **GREEDY}, stream=stream)
    if stream:
        text = "".join(e["choices"][0]["text"] for e in _events(resp) if e and e["choices"])
    else:
        text = resp.json()["choices"][0]["text"]
    assert text == PROMPTS[1] + want


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_echo_and_vllm_field_match_offline(server, offline, stream):
    """``echo`` with ``logprobs`` (OpenAI's legacy completions) and ``prompt_logprobs`` (vLLM's):
    every prompt token after the first gets the offline engine's prompt logprob and top k,
    colocated and disaggregated (made where the prompt is computed), streamed or whole."""
    _, url, _ = server
    ids = offline.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    want = offline.generate([ids], SamplingParams(**GREEDY, logprobs=2, prompt_logprobs=2))[0]
    body = {"prompt": ids, "echo": True, "logprobs": 2, "prompt_logprobs": 2, "stream": stream,
            **GREEDY}
    resp = _post(f"{url}/v1/completions", body, stream=stream)
    if stream:
        events = [e for e in _events(resp) if e and e["choices"]]
        choice = events[0]["choices"][0]
        lp = {k: [x for e in events for x in (e["choices"][0]["logprobs"] or {}).get(k, [])]
              for k in ("tokens", "token_logprobs")}
    else:
        choice = resp.json()["choices"][0]
        lp = choice["logprobs"]
    n = len(ids)
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == n + 12
    assert lp["token_logprobs"][1:n] == pytest.approx([x for x, _ in want.prompt_logprobs[1:]],
                                                      abs=1e-4)
    assert lp["token_logprobs"][n:] == pytest.approx(want.logprobs, abs=1e-4)
    field = choice["prompt_logprobs"]
    assert field[0] is None and len(field) == n
    for pos in range(1, n):
        got = {int(t): v["logprob"] for t, v in field[pos].items()}
        lp_pos, alts = want.prompt_logprobs[pos]
        assert got[ids[pos]] == pytest.approx(lp_pos, abs=1e-4)
        assert all(got[t] == pytest.approx(v, abs=1e-4) for t, v in alts)


def test_tokenize_and_detokenize_as_vllm_has_them(server, offline):
    _, url, _ = server
    want = offline.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    got = _post(f"{url}/tokenize", {"prompt": PROMPTS[1]}).json()
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 2048
    messages = [{"role": "user", "content": "What is two plus two?"}]
    chat = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert _post(f"{url}/tokenize", {"messages": messages}).json()["tokens"] == list(chat)
    assert _post(f"{url}/detokenize", {"tokens": want}).json()["prompt"] == PROMPTS[1]
    assert _post(f"{url}/detokenize", {"tokens": [99999]}).status_code == 400
    assert _post(f"{url}/tokenize", {"prompt": "a", "model": "other"}).status_code == 404


@pytest.mark.parametrize("raw, fragment", [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "a\\ud800b"}', "not valid Unicode"),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "hi", "seed": 18446744073709551616, "stream": true}', "seed"),
    (b'{"prompt": "hi", "max_tokens": 1e100}', "max_tokens"),
    (b'{"prompt": "caf\xe9"}', ""),  # not UTF-8
    (b'{"prompt": ', ""),
])
def test_malformed_values_are_a_400_in_openai_format(server, raw, fragment):
    _, url, _ = server
    resp = requests.post(f"{url}/v1/completions", data=raw, timeout=60,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_as_vllm_does(server):
    """Fields of other servers are accepted and ignored (a warning in the ingress's log); the
    answer is the one without them."""
    _, url, _ = server
    plain = _post(f"{url}/v1/completions", {"prompt": PROMPTS[0], **GREEDY}).json()
    extra = _post(f"{url}/v1/completions", {"prompt": PROMPTS[0], **GREEDY, "frobnicate": 1,
                                             "priority_class": "gold"})
    assert extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_chat_refuses_what_it_cannot_read(server):
    _, url, _ = server
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    resp = _post(f"{url}/v1/chat/completions", {"messages": [{"role": "user",
                                                              "content": image}]})
    assert resp.status_code == 400 and "image_url" in resp.json()["error"]["message"]


def test_shared_prefix_moves_fewer_blocks(server):
    mode, url, _ = server
    prefix = random_prompts([64], vocab=512, seed=52)[0]
    first = _post(f"{url}/v1/completions", {"prompt": prefix + [7, 8], **GREEDY}).json()
    second = _post(f"{url}/v1/completions", {"prompt": prefix + [9, 10, 11], **GREEDY}).json()
    if mode == "colocated":
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        return
    t1, t2 = first["usage"]["kv_transfer"], second["usage"]["kv_transfer"]
    assert t1["blocks_skipped"] == 0 and t1["blocks_sent"] == 5
    assert t2["blocks_skipped"] == 4 and t2["blocks_sent"] == 1
    assert t2["bytes"] < t1["bytes"]


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": ""}, "prompt: must not be empty"),
    ({"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n must be in [1, 128]"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of must be in [n=3"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of: not supported when streaming"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": "Infinity"}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty must be positive"),
    ({"prompt": "hi", "min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens must be in [0, max_tokens=5]"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias/stop_token_ids: token ids [99999]"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias: keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 200}}, "must be in [-100, 100]"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs: must be in [0, 20]"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, "outside the vocabulary"),
    ({"prompt": "hi", "stream_options": {"frobnicate": 1}}, "frobnicate"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [1] * 5000}, "leave no room"),
    ({"prompt": "hi", "max_tokens": 10**9}, "exceed the model's context"),
    ({}, "prompt"),
])
def test_bad_input_is_a_400_with_a_message(server, body, fragment):
    _, url, _ = server
    resp = _post(f"{url}/v1/completions", body)
    assert resp.status_code == 400
    assert fragment in resp.json()["error"]["message"]


def test_the_prefill_replica_warmed_its_link_to_the_decode_replica(server):
    mode, _, _ = server
    if mode == "colocated":
        pytest.skip("colocated: no KV links")
    decode_id = driver_handle("DecodeServer").kv_load.remote().result(timeout_s=30)["endpoint_id"]
    links = driver_handle("PrefillServer").kv_load.remote().result(timeout_s=30)["links"]
    assert links[decode_id]["state"] == "warm" and links[decode_id]["backend"] == "nixl"


def test_the_prefill_replica_makes_a_first_token_alone(server, offline):
    """The call a decode replica with no room makes (``FirstTokenRequest``): the prompt's first
    token through Serve, nothing pushed or held."""
    from contracts.messages import FirstTokenRequest

    mode, _, _ = server
    if mode == "colocated":
        pytest.skip("colocated: no prefill replica")
    params = SamplingParams(**GREEDY)
    prefill = driver_handle("PrefillServer")
    result = prefill.first_token.remote(FirstTokenRequest(
        tuple(PROMPTS_IDS), params, "first-token-alone")).result(timeout_s=30)
    assert result.first_token == offline.generate([PROMPTS_IDS], params)[0].token_ids[0]
    assert result.stats is None and result.num_prompt_tokens == len(PROMPTS_IDS)
    assert prefill.kv_load.remote().result(timeout_s=30)["held_blocks"] == 0


def test_requests_beyond_the_decode_replicas_slots_get_the_offline_tokens(server, offline):
    """Streams take the decode replica's 16 sequence slots, then more requests come: they find
    no room there and are queued (reason ``no_room``), their first token made by the prefill
    replica meanwhile; every answer carries the offline engine's tokens. (A burst of more than
    16 at once could be refused: Serve counts a request as queued until it is assigned.)"""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    mode, url, _ = server
    if mode == "colocated":
        pytest.skip("colocated: nothing is handed over")
    prompts = random_prompts([24] * 22, vocab=512, seed=57)
    long, short = {**GREEDY, "max_tokens": 128}, {**GREEDY, "max_tokens": 32}
    slots_taken = threading.Barrier(17, timeout=60)

    def answer(prompt, greedy, first_wave):
        events = _events(_post(f"{url}/v1/completions", {
            "prompt": prompt, "stream": True, **greedy,
            "stream_options": {"include_usage": True, "include_timing": True}}, stream=True))
        got = [next(events)]
        if first_wave:
            slots_taken.wait()  # this request holds a slot now
        got += [e for e in events if e]
        tokens = [t for e in got if e and e["choices"] for t in e["choices"][0]["token_ids"]]
        usage = got[-1]["usage"]
        return tokens, (usage["prefilled"]["reason"],
                        usage["timing"]["decode"]["first_token_by_prefill"])

    with ThreadPoolExecutor(len(prompts)) as pool:
        first = [pool.submit(answer, p, long, True) for p in prompts[:16]]
        slots_taken.wait()
        second = [pool.submit(answer, p, short, False) for p in prompts[16:]]
        first, second = [f.result() for f in first], [f.result() for f in second]
    want = [o.token_ids for o in offline.generate(prompts[:16], SamplingParams(**long))
            + offline.generate(prompts[16:], SamplingParams(**short))]
    assert [t for t, _ in first + second] == want
    assert {r for _, r in first} == {("always", False)}
    assert ("no_room", True) in {r for _, r in second}


def test_models_health_metrics(server):
    _, url, _ = server
    assert requests.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    card = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == "tiny"
    assert (card["quantization"], card["kv_cache_dtype"]) == (None, "auto")
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    for name in ("baton_time_to_first_token_seconds", "baton_inter_token_latency_seconds",
                 "baton_e2e_latency_seconds", "baton_requests_in_flight",
                 "baton_requests_total"):
        assert name in metrics
    # what the decode and prefill replicas know is theirs to report (through Ray), not the
    # ingress's: no KV or transfer series of one replica passed off as the app's
    for name in ("baton_kv_blocks_used", "baton_prefix_cache_hit_rate",
                 "baton_kv_transfer_bytes"):
        assert name not in metrics


def test_cancelled_stream_frees_every_block(server):
    _, url, _ = server
    before = _decode_engine_tokens()
    resp = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], "stream": True,
                                           "max_tokens": 1500, "ignore_eos": True}, stream=True)
    events = _events(resp)
    next(events), next(events)
    resp.close()  # the client goes away mid-stream
    _wait_idle(url)
    assert _decode_engine_tokens() - before < 1500  # aborted, not run to its end


def test_each_request_leaves_a_timeline_in_each_roles_serve_log(server):
    """One line per role under the request's id in the replicas' Serve logs (the decode and
    prefill replicas' lines among them: importing NIXL once closed their log handlers)."""
    mode, url, _ = server
    rid = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], **GREEDY}).json()["id"]
    logs = serve_log_dir()
    roles = ["ingress", "decode"] + (["prefill"] if mode == "disaggregated" else [])
    deadline, found = time.time() + 20, {}
    while len(found) < len(roles) and time.time() < deadline:
        for f in logs.glob("replica_baton_*.log"):
            for line in f.read_text(errors="replace").splitlines():
                for role in roles:
                    if f"request {rid} {role}:" in line:
                        found[role] = line
        time.sleep(0.2)
    assert sorted(found) == sorted(roles)
    assert "length" in found["ingress"] and "first_token +" in found["ingress"]
    assert ("prefilled remotely" in found["decode"]) == (mode == "disaggregated")
    if mode == "disaggregated":
        assert "push done" in found["prefill"]


def test_timing_fields_when_asked(server):
    mode, url, _ = server
    t0 = time.time()
    resp = _post(f"{url}/v1/completions", {"prompt": PROMPTS[0], "stream": True, **GREEDY,
                                           "stream_options": {"include_timing": True}},
                 stream=True)
    events = [e for e in _events(resp) if e]
    chunks, usage = [e for e in events if e["choices"]], events[-1]
    assert all(t0 <= c["produced_at"] <= time.time() for c in chunks)
    timing = usage["usage"]["timing"]
    router, decode = timing["router"], timing["decode"]
    assert t0 <= router["arrived"] <= router["received"] <= router["submitted"] \
        <= decode["received"]
    # a hand-over's first token may come ahead of its KV's landing (``queued``)
    assert decode["received"] <= min(decode["queued"], decode["first_token"])
    assert max(decode["queued"], decode["first_token"]) <= decode["finished"]
    # an early start's Serve call reaches the replica after the start (0.0: started by its call)
    assert decode["claimed"] == 0.0 or decode["received"] <= decode["claimed"]
    assert decode["first_token"] <= router["first_token"] <= router["finished"]
    assert (decode["prefill_called"] > 0) == (mode == "disaggregated")
    plain = [e for e in _events(_post(f"{url}/v1/completions", {"prompt": PROMPTS[0],
                                                                 "stream": True, **GREEDY},
                                      stream=True)) if e]
    assert "produced_at" not in plain[0] and "usage" not in plain[-1]


def test_one_timeline_across_the_roles(server):
    """A request's milestones from the ingress, decode and prefill replicas, in causal order,
    in the answer's usage (include_timing) and in one ingress log line; their durations add up
    to the time the client measured, less the HTTP hops."""
    mode, url, _ = server
    t0 = time.perf_counter()
    body = _post(f"{url}/v1/completions", {"prompt": PROMPTS[1], **GREEDY,
                                           "include_timing": True}).json()
    measured = time.perf_counter() - t0
    timing = body["usage"]["timing"]
    names = [name for name, _ in timing["phases"]]
    expected = ["arrived", "received", "submitted", "decode_received"]
    if mode == "disaggregated":  # in time order: the roles' paths run side by side
        expected += ["prefill_called"]
        assert names[:len(expected)] == expected and names[-1] == "finished"
        ahead = "prefill_sampled" in names  # its first token came over the decode's sink
        assert sorted(names[len(expected):-1]) == sorted(
            ["reserved", "prefill_received", "prefill_added", "prefilled", "pushed",
             "prefill_returned", "admitted", "decode_first_token", "first_token"]
            + (["prefill_sampled", "first_arrived"] if ahead else []))
        # what causes what comes after it, each chain on the clocks of one host
        chains = [["prefill_called", "prefill_received", "prefill_added", "prefilled",
                   "pushed", "prefill_returned", "admitted"], ["reserved", "admitted"],
                  ["decode_first_token", "first_token"]]
        if ahead:
            chains.append(["prefill_added", "prefill_sampled", "first_arrived",
                           "decode_first_token"])
            chains.append(["prefill_sampled", "prefilled"])
        for chain in chains:
            assert [names.index(n) for n in chain] == sorted(names.index(n) for n in chain)
    else:
        expected += ["queued"]
        assert names == expected + ["decode_first_token", "first_token", "finished"]
    stamps = [at for _, at in timing["phases"]]
    assert stamps == sorted(stamps)
    durations = [b - a for a, b in zip(stamps, stamps[1:])]
    assert sum(durations) == pytest.approx(stamps[-1] - stamps[0], abs=1e-6)
    assert 0 <= measured - (stamps[-1] - stamps[0]) < 0.25  # the HTTP hops, on a busy 2-core CI
    replicas = timing["replicas"]
    assert replicas["ingress"] and replicas["decode"]
    assert bool(replicas["prefill"]) == (mode == "disaggregated")
    rid = body["id"]
    deadline, line = time.time() + 20, None
    while line is None and time.time() < deadline:
        for f in serve_log_dir().glob("replica_baton_Router_*.log"):
            line = next((x for x in f.read_text(errors="replace").splitlines()
                         if f"request {rid} ingress:" in x), line)
        time.sleep(0.2)
    assert line is not None and f"decode {replicas['decode']}" in line
    assert all(f"{name} +" in line for name in names)


@pytest.fixture(scope="module")
def stub(server):
    import grpc

    from proto import baton_pb2_grpc
    channel = grpc.insecure_channel(server[2])
    yield baton_pb2_grpc.BatonStub(channel)
    channel.close()


def test_grpc_unary_and_stream_match_offline(stub, offline):
    from proto import baton_pb2
    want = offline.generate(PROMPTS[0], SamplingParams(**GREEDY))[0]
    req = baton_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    ignore_eos=True)
    t0 = time.perf_counter()
    resp = stub.Generate(req, timeout=60)
    elapsed = time.perf_counter() - t0
    assert list(resp.token_ids) == want.token_ids and resp.text == want.text
    assert resp.finish_reason == "length" and resp.usage.completion_tokens == 12
    assert 0 < resp.ttft_s < elapsed
    t0 = time.perf_counter()
    msgs = list(stub.GenerateStream(req, timeout=60))
    assert 0 < msgs[-1].ttft_s < time.perf_counter() - t0
    ids = offline.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    lp = offline.generate([ids], SamplingParams(**GREEDY, prompt_logprobs=2))[0].prompt_logprobs
    asked = baton_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=2, temperature=0,
                                      prompt_logprobs=2)
    for got in (stub.Generate(asked, timeout=60), next(iter(stub.GenerateStream(asked,
                                                                                timeout=60)))):
        assert list(got.prompt_logprobs) == pytest.approx([x for x, _ in lp[1:]], abs=1e-4)
        assert [list(t.token_ids) for t in got.prompt_top_logprobs] == \
            [[t for t, _ in alts] for _, alts in lp[1:]]
    assert [t for m in msgs for t in m.token_ids] == want.token_ids
    assert all(m.produced_at > 0 for m in msgs if m.token_ids)
    assert "".join(m.text for m in msgs) == want.text
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.prompt_tokens > 0
    ids = random_prompts([20], vocab=512, seed=53)[0]
    resp = stub.Generate(baton_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=12,
                                                   temperature=0, ignore_eos=True), timeout=60)
    assert list(resp.token_ids) == offline.generate([ids], SamplingParams(**GREEDY))[0].token_ids
    assert stub.Health(baton_pb2.HealthRequest(), timeout=10).status == "ok"


def test_grpc_timing_when_asked(server, stub):
    """``include_timing`` over gRPC: the unary answer carries the request's timeline, and a
    stream ends with one more message, without tokens, that carries it; the timeline is HTTP's
    (the ingress's and the replicas' milestones in causal order) less HTTP's own ``arrived``."""
    from proto import baton_pb2
    mode = server[0]
    req = baton_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                    ignore_eos=True, include_timing=True, request_id="t")
    t0 = time.time()
    msgs = list(stub.GenerateStream(req, timeout=60))
    unary = stub.Generate(req, timeout=60)
    *tokens, last = msgs
    assert sum(len(m.token_ids) for m in tokens) == 4 and tokens[-1].finish_reason == "length"
    assert not last.token_ids and last.request_id == "t" and not tokens[-1].timing_json
    for answer in (last, unary):
        timing = json.loads(answer.timing_json)
        router, decode = timing["router"], timing["decode"]
        assert "arrived" not in [name for name, _ in timing["phases"]]
        assert t0 <= router["received"] <= router["submitted"] <= decode["received"]
        assert decode["first_token"] <= router["first_token"] <= router["finished"] <= time.time()
        assert (decode["prefill_called"] > 0) == (mode == "disaggregated")
        assert timing["replicas"]["decode"]
    assert len(unary.token_ids) == 4
    plain = list(stub.GenerateStream(baton_pb2.GenerateRequest(
        prompt=PROMPTS[0], max_tokens=4, temperature=0, ignore_eos=True), timeout=60))
    assert all(m.token_ids for m in plain) and not any(m.timing_json for m in plain)
    assert not stub.Generate(baton_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=2),
                             timeout=60).timing_json


def test_grpc_client_request_ids_need_not_be_unique(stub, offline):
    """A client's request_id is echoed, not used as a key: two at once with one id both
    complete with their own tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from proto import baton_pb2
    prompts = random_prompts([12, 30], vocab=512, seed=54)
    reqs = [baton_pb2.GenerateRequest(prompt_token_ids=p, max_tokens=12, temperature=0,
                                      ignore_eos=True, request_id="mine") for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        resps = list(pool.map(lambda r: stub.Generate(r, timeout=60), reqs))
    for p, resp in zip(prompts, resps):
        assert resp.request_id == "mine"
        assert list(resp.token_ids) == offline.generate([p], SamplingParams(**GREEDY))[0].token_ids


def test_grpc_sampling_fields_and_top_logprobs(stub, offline):
    from proto import baton_pb2
    prompt = PROMPTS_IDS[:16]
    fields = dict(temperature=0.9, seed=8, presence_penalty=0.7, frequency_penalty=0.3,
                  repetition_penalty=1.2, min_p=0.05, min_tokens=6, logit_bias={21: 3.0})
    want = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2,
                                                     **fields))[0]
    req = baton_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=10, ignore_eos=True,
                                    logprobs=True, top_logprobs=2, **fields)
    for msgs in ([stub.Generate(req, timeout=60)], list(stub.GenerateStream(req, timeout=60))):
        assert [t for m in msgs for t in m.token_ids] == want.token_ids
        tops = [e for m in msgs for e in m.top_logprobs]
        assert [list(e.token_ids) for e in tops] == [[t for t, _ in top]
                                                     for top in want.top_logprobs]
        assert [lp for m in msgs for lp in m.logprobs] == pytest.approx(want.logprobs, abs=1e-4)


def test_grpc_structured_outputs(stub, offline):
    import grpc

    from engine.structured import StructuredOutput
    from proto import baton_pb2
    options = ["yes", "no", "maybe so"]
    want = offline.generate([PROMPTS[1]], SamplingParams(
        temperature=1.0, seed=4, max_tokens=30,
        structured_output=StructuredOutput.choice(options)))[0]
    resp = stub.Generate(baton_pb2.GenerateRequest(
        prompt=PROMPTS[1], temperature=1.0, seed=4, max_tokens=30,
        choice=baton_pb2.Choices(options=options)), timeout=60)
    assert list(resp.token_ids) == want.token_ids and resp.text in options
    resp = stub.Generate(baton_pb2.GenerateRequest(prompt=PROMPTS[1], temperature=0,
                                                   max_tokens=30, regex=r"\d{4}"), timeout=60)
    assert re.fullmatch(r"\d{4}", resp.text) and resp.finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(baton_pb2.GenerateRequest(prompt="hi", json_schema='{"type": 1'),
                      timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema" in err.value.details()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_grpc_cancel_and_deadline_stop_the_request(server, stub, how):
    """A gRPC client that cancels, or whose deadline passes, ends the request on the server:
    the engine stops making its tokens and every block comes back."""
    import grpc

    from proto import baton_pb2
    _, url, _ = server
    before = _decode_engine_tokens()
    req = baton_pb2.GenerateRequest(prompt_token_ids=PROMPTS_IDS, max_tokens=1500,
                                    temperature=0, ignore_eos=True)
    call = stub.GenerateStream(req, timeout=1.0 if how == "deadline" else 60)
    with pytest.raises(grpc.RpcError) as err:
        for i, _msg in enumerate(call):
            if how == "cancel" and i == 2:
                call.cancel()
    assert err.value.code() == (grpc.StatusCode.CANCELLED if how == "cancel"
                                else grpc.StatusCode.DEADLINE_EXCEEDED)
    _wait_idle(url)
    made = _decode_engine_tokens() - before
    time.sleep(0.5)
    assert _decode_engine_tokens() - before == made < 1500


@pytest.mark.parametrize("fields, fragment", [
    (dict(prompt=""), "prompt: must not be empty"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt_token_ids=[1, 99999]), "outside the vocabulary"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", max_tokens=2**32 - 1), "max_tokens"),
    (dict(prompt="hi", prompt_token_ids=[1]), "either prompt or prompt_token_ids"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
    (dict(prompt="hi", repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(prompt="hi", logit_bias={99999: 1.0}), "outside the vocabulary"),
    (dict(prompt="hi", logit_bias={3: -500.0}), "must be in [-100, 100]"),
    (dict(prompt="hi", top_logprobs=2), "top_logprobs: needs logprobs=true"),
    (dict(prompt="hi", logprobs=True, top_logprobs=40), "logprobs: must be in [0, 20]"),
    (dict(prompt="hi", max_tokens=4, min_tokens=9), "min_tokens"),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_grpc_bad_input_is_invalid_argument(stub, fields, fragment, streaming):
    import grpc

    from proto import baton_pb2
    req = baton_pb2.GenerateRequest(**fields)
    with pytest.raises(grpc.RpcError) as err:
        if streaming:
            list(stub.GenerateStream(req, timeout=30))
        else:
            stub.Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()


@pytest.mark.parametrize("streaming", [False, True])
def test_grpc_names_an_unknown_model_as_http_does(server, stub, streaming):
    """A model this app does not serve: HTTP 404, gRPC NOT_FOUND, the same message."""
    import grpc

    from proto import baton_pb2
    _, url, _ = server
    http = _post(f"{url}/v1/completions", {"prompt": "hi", "model": "nope"})
    req = baton_pb2.GenerateRequest(prompt="hi", model="nope")
    with pytest.raises(grpc.RpcError) as err:
        if streaming:
            list(stub.GenerateStream(req, timeout=30))
        else:
            stub.Generate(req, timeout=30)
    assert http.status_code == 404 and err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == http.json()["error"]["message"]


@pytest.mark.parametrize("http, grpc_fields", [
    ({"prompt": ""}, dict(prompt="")),
    ({"prompt": "hi", "temperature": -1}, dict(prompt="hi", temperature=-1.0)),
    ({"prompt": "hi", "top_p": 0}, dict(prompt="hi", top_p=0.0)),
    ({"prompt": [1, 99999]}, dict(prompt_token_ids=[1, 99999])),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, dict(prompt="hi", max_tokens=4,
                                                               min_tokens=9)),
    ({"prompt": "hi", "logit_bias": {"3": -500}}, dict(prompt="hi", logit_bias={3: -500.0})),
    ({"prompt": "hi", "logprobs": 40}, dict(prompt="hi", logprobs=True, top_logprobs=40)),
    ({"prompt": "hi", "structured_outputs": {"regex": "("}}, dict(prompt="hi", regex="(")),
    ({"prompt": "hi", "max_tokens": 10**9}, dict(prompt="hi", max_tokens=10**9)),
])
def test_grpc_and_http_refuse_the_same_request_with_the_same_message(server, stub, http,
                                                                      grpc_fields):
    """gRPC reads a request into HTTP's request model: one set of checks, one message."""
    import grpc

    from proto import baton_pb2
    _, url, _ = server
    resp = _post(f"{url}/v1/completions", http)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(baton_pb2.GenerateRequest(**grpc_fields), timeout=30)
    assert resp.status_code == 400 and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == resp.json()["error"]["message"]


@pytest.mark.parametrize("streaming", [False, True])
def test_grpc_n_sequences_equal_the_offline_engines(stub, offline, streaming):
    """gRPC's n as HTTP's: sequence i draws with seed + i and shares the prompt's KV."""
    from proto import baton_pb2
    sampled = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in offline.generate([PROMPTS[0]], SamplingParams(n=3, **sampled))[0]]
    req = baton_pb2.GenerateRequest(prompt=PROMPTS[0], n=3, **sampled)
    if streaming:
        got = {}
        for msg in stub.GenerateStream(req, timeout=60):
            got.setdefault(msg.index, []).extend(msg.token_ids)
        assert [got[i] for i in range(3)] == want
    else:
        resp = stub.Generate(req, timeout=60)
        assert [list(c.token_ids) for c in resp.choices] == want
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert list(resp.token_ids) == want[0] and resp.finish_reason == "length"
