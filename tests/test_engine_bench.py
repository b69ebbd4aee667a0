"""engine_bench's timing points for speculative decoding, on the CPU: the forced verification
(``forced``/``kept70``) called as the engine calls ``verify``, keeping its share of the
proposals."""

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
