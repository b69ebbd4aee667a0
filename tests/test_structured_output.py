"""Structured outputs in the engine: every token keeps the output inside its grammar (JSON of a
schema, a JSON object, a regex, a choice, an EBNF grammar), with the engine one step ahead or
not, and a request resumed with its tokens so far goes on as one run would."""

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
PROMPTS = ["Tell me about", "x", "hello there", "The quick brown fox"]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    return LLM("tiny", async_scheduling=request.param)


def _follows(llm, so, token_ids) -> bool:
    """Every token is accepted by a fresh matcher of the grammar."""
    m = llm.engine.grammars.matcher(so)
    return all(m.accept_token(t) for t in token_ids)


@pytest.mark.parametrize("so", [StructuredOutput.schema(SCHEMA),
                                StructuredOutput(kind="json_object")], ids=["schema", "object"])
def test_json_outputs_follow_the_grammar_and_parse_when_finished(llm, so):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_output=so)
              for s in range(4)]
    outs = llm.generate(PROMPTS, params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished  # the random model closes some of them within 300 tokens
    for out in outs:
        assert _follows(llm, so, out.token_ids)
    for out in finished:
        value = json.loads(out.text, strict=False)  # xgrammar lets raw control chars in strings
        assert isinstance(value, dict)
        if so.kind == "json_schema":
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
            assert 0 <= value["n"] <= 99


def test_choice_regex_and_grammar(llm):
    options = ["yes", "no", "maybe so"]
    cases = [(StructuredOutput.choice(options), lambda t: t in options),
             (StructuredOutput(kind="regex", spec=r"[a-c]{3}-\d{2}"),
              lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
             (StructuredOutput(kind="grammar", spec='root ::= "(" [0-9]+ ")" | "none"'),
              lambda t: re.fullmatch(r"\(\d+\)|none", t))]
    for so, check in cases:
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=t, seed=3, max_tokens=40,
                                                     structured_output=so)
                                      for t in (0, 0.7, 1.0, 1.5)])
        for out in outs:
            if so.kind != "grammar":
                assert out.finish_reason == "stop", (so, out.text)
            if out.finish_reason == "stop":
                assert check(out.text), (so, out.text)
    # ignore_eos does not run past a finished grammar: the grammar ends it.
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                           structured_output=cases[0][0]))[0]
    assert out.finish_reason == "stop" and out.text in options
    assert llm.engine.pool.num_used_blocks == 0


def test_a_grammar_row_does_not_change_its_neighbours(llm):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    mixed = llm.generate(PROMPTS + PROMPTS[:1], [plain] * 4 + [SamplingParams(
        temperature=0, max_tokens=20, structured_output=StructuredOutput.choice(["a", "b"]))])
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]


def test_a_resumed_request_replays_its_tokens_through_the_grammar(llm):
    so = StructuredOutput.schema(SCHEMA)
    p = SamplingParams(temperature=1.0, seed=2, max_tokens=120, structured_output=so)
    whole = llm.generate(PROMPTS[2], p)[0].token_ids
    cut = 7
    rest = llm.generate(llm.engine.tokenize(PROMPTS[2]) + whole[:cut], p.model_copy(update={
        "max_tokens": 120 - cut, "num_resumed_tokens": cut}))[0].token_ids
    assert rest == whole[cut:]


@pytest.mark.parametrize("so, message", [
    (StructuredOutput(kind="json_schema", spec='{"type": "objec'), "response_format.json_schema"),
    (StructuredOutput(kind="json_schema", spec='{"type": "frob"}'), "Unsupported type"),
    (StructuredOutput(kind="regex", spec="(ab"), "guided_regex: Regex parsing error"),
    (StructuredOutput(kind="grammar", spec="root ::= "), "guided_grammar: EBNF parser error"),
])
def test_a_bad_spec_is_a_value_error_naming_the_field(llm, so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_output=so))
    assert not llm.engine.has_unfinished_requests()


def test_choice_needs_strings():
    with pytest.raises(ValueError, match="guided_choice"):
        StructuredOutput.choice([])


def test_chunked_prefill_and_n_sequences_under_a_grammar():
    """A prompt prefilled in chunks, and n sequences sharing it, sample under the grammar as a
    one-chunk prefill does."""
    so = StructuredOutput.schema(SCHEMA)
    prompt = "The quick brown fox jumps over the lazy dog " * 6
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=80, structured_output=so, n=3)
    whole = LLM("tiny", max_num_batched_tokens=2048).generate(prompt, params)[0]
    chunked = LLM("tiny", max_num_batched_tokens=16).generate(prompt, params)[0]
    assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
    assert len({tuple(c.token_ids) for c in whole}) > 1


def test_compact_json_finishes_where_any_whitespace_does_not(llm):
    """Greedy on the random tiny model, any whitespace allowed: it pads with whitespace until
    max_tokens. Compact JSON (vLLM's disable_any_whitespace) leaves it no padding: it closes."""
    loose = StructuredOutput.schema(SCHEMA)
    compact = loose.model_copy(update={"compact": True})
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=60,
                                                 structured_output=so)
                                  for so in (loose, compact, loose, compact)])
    assert [o.finish_reason for o in outs[::2]] == ["length", "length"], [o.text for o in outs]
    assert [o.finish_reason for o in outs[1::2]] == ["stop", "stop"]
    for out in outs[1::2]:
        value = json.loads(out.text)
        assert set(value) == {"ok", "n"} and out.text == json.dumps(value)  # no padding
