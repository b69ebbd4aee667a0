"""Speculative decoding on the GPU, where the draft's step ahead is written by a kernel and
replays the draft's decode graph (engine.draft_model): Qwen3-0.6B (random weights) as its own
draft, bf16, FlashInfer and the few-row attention kernel, CUDA graphs.

The step ahead reads its positions, tokens and pages on the device from the verification's
result; were any of them wrong, the draft's cache would hold other tokens' KV and its proposals
would stop agreeing with the target (acceptance near 0 for random weights). So: the same
tokens with the step ahead and without (and, for one sequence, those of no speculation), and
the same acceptance, near 1, over batches of 1 to 4 sequences (a row each; a padded graph at
3) whose positions cross block boundaries; and most rounds take the step ahead."""

import pytest

from engine import LLM, SamplingParams
from tests.models import random_prompts

pytestmark = pytest.mark.gpu

DRAFT = {"method": "draft_model", "model": "dummy:Qwen3-0.6B", "num_speculative_tokens": 4}
PARAMS = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)


def _run(prompts, spec, ahead: bool, monkeypatch):
    import engine.draft_model as dm
    from engine.spec_decode import SpecController
    monkeypatch.setattr(dm, "AHEAD", ahead)
    llm = LLM("dummy:Qwen3-0.6B", device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              num_blocks=512, max_num_seqs=8, show_progress=False, seed=0,
              speculative_config=spec)
    if spec is not None:
        llm.engine.spec = SpecController(min_acceptance=0.0, empty_steps=10**9, min_gain=None,
                                         start_on=True)
    tokens = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    engine = llm.engine
    assert engine.pool.num_used_blocks == 0
    if spec is None:
        return tokens, None
    stats, drafter = engine.spec_stats, engine.drafter
    return tokens, (stats.num_accepted_tokens / stats.num_draft_tokens, drafter.steps_ahead,
                    drafter.seqs_ahead, stats.num_drafts)


@pytest.mark.parametrize("lengths", [[29], [13, 40, 31], [16, 17, 45, 8]],
                         ids=["one", "three", "four"])
def test_the_kernel_written_step_ahead_keeps_the_tokens_and_the_acceptance(lengths, monkeypatch):
    prompts = random_prompts(lengths, seed=7, vocab=151936)
    ref, _ = _run(prompts, None, False, monkeypatch)
    on, (acc_on, steps, seqs, rounds) = _run(prompts, DRAFT, True, monkeypatch)
    off, (acc_off, none, _, _) = _run(prompts, DRAFT, False, monkeypatch)
    # one sequence: the target's tokens are those of no speculation; a batch verifies in
    # graphs of other shapes than it decodes in, and random weights' near-ties then differ in
    # bf16, so there the two speculating runs are compared
    assert on == off and (len(prompts) > 1 or on == ref)
    assert none == 0 and steps > 0 and seqs >= rounds // 2
    assert acc_on > 0.8 and acc_on >= acc_off - 0.05, (acc_on, acc_off)
