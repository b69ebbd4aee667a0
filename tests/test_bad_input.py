"""Every bad input raises ValueError naming the field, and leaves nothing queued."""

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_model_len=64)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(max_tokens="many"), "max_tokens"),
    (dict(unknown_field=1), "unknown_field"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt: must not be empty"),
    ([], "prompt: must not be empty"),
    ([1] * 64, "prompt: 64 tokens leave no room"),
    ([1, 2, 512], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    ([1.5], "must be integers"),
    ([1, True], "must be integers"),
    ([3, "4"], "must be integers"),
    ([1, 2, 1.0], "must be integers"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt])
    assert not llm.engine.has_unfinished_requests()


def test_the_prompt_checks_name_the_same_ids_on_their_fast_and_slow_paths():
    """The checks run in C over plain ints and fall back to a per-id pass for anything else:
    an int subclass other than bool is an id, the first five ids outside the vocabulary are
    named in order, and ids from any iterable (a generator: the parameters' own) are checked."""
    import enum

    from engine.errors import BadRequest
    from engine.validation import RequestChecks

    class Tok(enum.IntEnum):
        A = 7

    checks = RequestChecks("m", vocab_size=100, max_model_len=1000, has_tokenizer=False)
    assert checks.prompt([Tok.A, 1, 99]) == [Tok.A, 1, 99]
    assert checks.prompt(list(range(100))) == list(range(100))
    with pytest.raises(BadRequest, match=r"token ids \[100, -1, 250, 101, 102\] are outside "
                                         r"the vocabulary \[0, 100\)"):
        checks.prompt([5, 100, -1, 250, 6, 101, 102, 103, 99])
    with pytest.raises(BadRequest, match=r"stop: token ids \[-3\]"):
        checks.in_vocabulary((t for t in (1, -3, 2)), "stop")
    checks.in_vocabulary((t for t in ()), "stop")
    checks.in_vocabulary(iter([0, 99]), "stop")


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""])
    assert not llm.engine.has_unfinished_requests()


def test_text_prompt_without_tokenizer():
    llm = LLM("dummy:Qwen3-0.6B", device="cpu", dtype="bfloat16", num_blocks=8,
              max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([1, 2, 3], SamplingParams(stop=["x"]))
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2 and out.text is None


def test_mismatched_param_count(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_engine_config_takes_a_torch_dtype():
    import torch

    from engine import EngineConfig
    assert EngineConfig(dtype=torch.float32).dtype == "float32"
    assert EngineConfig(dtype=torch.bfloat16).dtype == "bfloat16"


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("inf")), "top_p"),
    (dict(seed=2**64), "seed"),
])
def test_sampling_params_refuse_non_finite_and_oversized_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_config():
    with pytest.raises(ValueError, match="block_size"):
        LLM("tiny", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny", dtype="float8")
    with pytest.raises(ValueError, match="unknown dummy model"):
        LLM("dummy:Qwen3-3B")
    with pytest.raises(ValueError, match="not 'tiny'"):
        LLM("/nonexistent/folder")
