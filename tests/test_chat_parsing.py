"""Qwen3's chat output split into reasoning, content and tool calls, whole and streamed."""

import json

import pytest

from router.ingress.chat import StreamSplitter, parse_tool_calls, split_message, tool_grammar

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "<think>\nLet me see <maybe>.\n</think>\n\nIt is <b>sunny</b>.",
    f"<think>\nhm\n</think>\n\nChecking.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}",
    CALL,
    "<think>\ncut off while thinking\n\n",
    "no markup at all\n",
    "<think></think>x",
    "<thin",
    "a <tool_call>not json</tool_call> b",
    "\n\n<think>not leading</think>y",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_stream_splits_as_the_whole_text_does(text, step):
    whole = split_message(text, reasoning=True, tools=True)
    s = StreamSplitter(reasoning=True, tools=True)
    parts = []
    for i in range(0, len(text), step):
        parts += s.feed(text[i:i + step])
    parts += s.finish()
    got = {"reasoning_content": None, "content": ""}
    for kind, piece in parts:
        got[kind] = (got[kind] or "") + piece
    assert got["reasoning_content"] == whole[0]
    assert got["content"] == whole[1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in s.tool_calls] == [(c["function"]["name"],
                                        json.loads(c["function"]["arguments"]))
                                       for c in whole[2]]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_tool_call_arguments_stream_as_they_are_generated(step):
    """OpenAI's streamed form: a first delta with index, id, type and name, then the arguments'
    JSON in pieces that join to the call's arguments; nothing of the closing markup."""
    args = '{"city": "Paris", "days": [1, 2], "opts": {"units": "metric"}}'
    text = ("Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + args +
            "}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"now\"}\n</tool_call>")
    s = StreamSplitter(reasoning=True, tools=True)
    deltas, content, when = [], "", []
    for i in range(0, len(text), step):
        content += "".join(t for _, t in s.feed(text[i:i + step]))
        new = s.take_calls()
        deltas += new
        when += [i] * len(new)
    content += "".join(t for _, t in s.finish())
    deltas += s.take_calls()
    assert content == "Checking."
    first, rest = deltas[0], [d for d in deltas if d["index"] == 0][1:]
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert "".join(d["function"]["arguments"] for d in rest) == args
    if step == 1:  # the arguments went out while the call was being written
        assert len(rest) > 10 and when[1] < text.index("</tool_call>")
    second = [d for d in deltas if d["index"] == 1]  # arguments first: whole, at its close
    assert len(second) == 1 and second[0]["function"]["name"] == "now"
    assert json.loads(second[0]["function"]["arguments"]) == {}


def test_whole_texts():
    assert split_message(TEXTS[0], True, True) == ("Let me see <maybe>.",
                                                  "It is <b>sunny</b>.", [])
    reasoning, content, calls = split_message(TEXTS[1], True, True)
    assert (reasoning, content) == ("hm", "Checking.")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                      {"city": "Oslo"}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert split_message(TEXTS[0], False, False) == (None, TEXTS[0], [])  # parsers off
    assert parse_tool_calls(TEXTS[7]) == (TEXTS[7], [])  # a call that does not parse: content
    assert split_message(TEXTS[3], True, False) == ("cut off while thinking\n\n", "", [])


def test_tool_grammar_admits_calls_of_the_offered_functions_only():
    import xgrammar as xgr

    from engine.model_source import load_tokenizer, resolve_model
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "now"}}]
    tok = load_tokenizer(resolve_model("tiny"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=512))

    def admits(text, name=None, parallel=True):
        m = xgr.GrammarMatcher(compiler.compile_grammar(tool_grammar(tools, name, parallel)))
        return m.accept_string(text)

    two = CALL + "\n" + CALL.replace('"get_weather", "arguments": {"city": "Paris"}',
                                     '"now", "arguments": {}')
    assert admits(CALL) and admits(two)
    assert not admits(two, parallel=False)
    assert not admits(CALL, name="now")
    assert not admits(CALL.replace("get_weather", "get_time"))
    assert not admits(CALL.replace('"city"', '"town"'))
    with pytest.raises(ValueError, match="tools: "):
        tool_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "frob"}}}], None, True)


def test_streamed_arguments_are_strict_json_even_with_raw_control_characters():
    """A model may write a raw control character inside a string (a whole call's parse
    tolerates it); streamed pieces escape it, so clients' strict json.loads reads the join."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "x\x18y\\"\t", "b": [1,\n 2]}}\n</tool_call>'
    for step in (1, 4, 1000):
        s = StreamSplitter(reasoning=False, tools=True)
        deltas = []
        for i in range(0, len(text), step):
            s.feed(text[i:i + step])
            deltas += s.take_calls()
        s.finish()
        deltas += s.take_calls()
        joined = "".join(d["function"].get("arguments", "") for d in deltas)
        assert json.loads(joined) == {"a": 'x\x18y"\t', "b": [1, 2]}


def test_a_raw_control_character_in_a_streamed_name_parses_as_in_a_whole_answer():
    text = '<tool_call>\n{"name": "get\tweather", "arguments": {}}\n</tool_call>'
    s = StreamSplitter(reasoning=False, tools=True)
    s.feed(text)
    deltas = s.take_calls()
    s.finish()
    deltas += s.take_calls()
    _, whole = parse_tool_calls(text)
    assert deltas[0]["function"]["name"] == whole[0]["function"]["name"] == "get\tweather"


def test_tool_call_arguments_nested_past_the_parsers_depth_are_rendered_as_sent():
    """An assistant message's arguments that are not JSON, or nested deeper than the parser
    goes (a 200 KB body of brackets), go to the template as the text sent: never a 500."""
    from router.ingress.protocol import ChatMessage

    deep = "[" * 100_000
    m = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}])
    assert m.for_template()["tool_calls"][0]["function"]["arguments"] == deep
