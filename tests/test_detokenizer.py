"""Incremental detokenization: the pieces join to a full decode of the ids (random ids too, with
their broken UTF-8), stop strings end the text at the token that completes them, and text that
could still become a stop string is held back."""

import random

import pytest

from engine import LLM, OutputCollector, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, decoder_of
from engine.model_source import load_tokenizer, resolve_model
from engine.outputs import RequestOutput


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("tiny"))


def _stream(tok, ids, stop=()):
    d = IncrementalDetokenizer(tok, stop)
    pieces, stopped_at = [], None
    for i, t in enumerate(ids):
        if d.add(t):
            stopped_at = i
            break
        pieces.append(d.take())
    d.finish()
    pieces.append(d.take())
    return d, "".join(pieces), stopped_at


def test_pieces_join_to_the_full_decode_of_random_ids(tok):
    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 50))]
        d, joined, _ = _stream(tok, ids)
        full = tok.decode(ids, skip_special_tokens=True)
        assert joined == full == d.text


def test_pieces_join_to_the_full_decode_of_text(tok):
    text = "Hello wörld, ünïcödé — 東京 and emoji 🚀 done."
    ids = tok.encode(text, add_special_tokens=False)
    _, joined, _ = _stream(tok, ids)
    assert joined == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_at_the_completing_token(tok):
    ids = tok.encode("one two three four five", add_special_tokens=False)
    d, joined, at = _stream(tok, ids, stop=["three"])
    assert joined == "one two " and d.stop_reason == "three"
    assert "three" in tok.decode(ids[: at + 1]) and "three" not in tok.decode(ids[:at])


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("abc def ghi", add_special_tokens=False)
    d, joined, _ = _stream(tok, ids, stop=["ghi", "def"])
    assert joined == "abc " and d.stop_reason == "def"


def test_text_that_may_become_a_stop_string_is_held_back(tok):
    d = IncrementalDetokenizer(tok, stop=["xyz!"])
    sent = ""
    for t in tok.encode("hello xy", add_special_tokens=False):
        d.add(t)
        sent += d.take()
    assert "hello xy".startswith(sent) and len(sent) <= len("hello xy") - 3
    d.finish()
    assert sent + d.take() == "hello xy"


def test_collector_matches_the_offline_engine_with_a_stop_string(tok):
    llm = LLM("tiny")
    full = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=30,
                                                              ignore_eos=True))[0]
    stop = full.text[4:7]
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=30,
                                                             ignore_eos=True, stop=[stop]))[0]
    # Fed the unstopped run's tokens one delta at a time, a collector stops at the same token.
    c = OutputCollector("r", [1], SamplingParams(stop=[stop], max_tokens=30), tok)
    for i, t in enumerate(full.token_ids):
        if c.add(RequestOutput("r", [t], num_output_tokens=i + 1)):
            break
    assert c.result.token_ids == out.token_ids and c.result.text == out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert llm.engine.pool.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_decoder_of_uses_the_fast_backend_when_exact(tok):
    ids = [100, 200, 300]
    assert decoder_of(tok)(ids) == tok.decode(ids, skip_special_tokens=True)
