"""A step's results into its requests (vLLM v1's ``Scheduler.update_from_output``).

A launched step's sampled ids become each sequence's tokens; then the stop conditions (EOS, stop
token ids, ``max_tokens``, the context) and a structured output's grammar decide whether it
ends, and a :class:`~engine.outputs.RequestOutput` delta is made for it. The engine stops on token
ids only; stop strings belong to whoever turns tokens into text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import RequestOutput, TopLogprobs
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence

log = logging.getLogger("engine.llm_engine")


@dataclass
class LaunchedStep:
    """A step queued on the device: the sequences due a token (row ``i`` of ``tokens``), the
    sampled ids on the device, their host copies (valid once ``done`` has fired)."""

    due: list[Sequence]
    tokens: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    host_logprobs: torch.Tensor | None = None
    host_top_ids: torch.Tensor | None = None
    host_top_logprobs: torch.Tensor | None = None
    prompt: object | None = None  # model_runner.PromptLogprobs, host copies
    done: torch.cuda.Event | None = None
    releases: int = 0  # the scheduler's release count right after the launch
    # engine.step_cost.StepCost marks around the launch, and the prompt tokens it computes
    started: object | None = None
    done_at: object | None = None
    prompt_tokens: int = 0
    # speculative decoding: each due sequence's new tokens (engine.spec_decode.verify), known
    # on the host already
    spec: list[list[int]] | None = None
    # and, for those that asked, their logprobs (engine.spec_decode.verified_logprobs)
    spec_logprobs: list | None = None

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class StepUpdater:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, eos_token_ids: frozenset[int],
                 max_model_len: int):
        self.scheduler, self.kv = scheduler, kv
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step and turn its sampled ids into tokens and outputs."""
        if step.prompt is None and not step.due:
            return []
        step.wait()
        if step.prompt is not None:
            _store_prompt_logprobs(step.prompt)
        if not step.due:
            return []
        if step.spec is not None:
            lps = step.spec_logprobs or [None] * len(step.due)
            return [self._resolve_verified(seq, tokens, lp)
                    for seq, tokens, lp in zip(step.due, step.spec, lps) if not seq.is_finished]
        tokens = step.host_tokens.tolist()
        logprobs = step.host_logprobs.tolist() if step.host_logprobs is not None else None
        top_ids = step.host_top_ids.tolist() if step.host_top_ids is not None else None
        top_lps = step.host_top_logprobs.tolist() if step.host_top_ids is not None else None
        outputs = []
        for i, (seq, token) in enumerate(zip(step.due, tokens)):
            if seq.is_finished:  # stopped (or aborted) while this step ran: drop its token
                continue
            seq.resolve_pending(token)
            self.kv.commit(seq)
            self._check_stop(seq, token)
            self._advance_grammar(seq, token)
            k = seq.params.logprobs
            outputs.append(self.output(
                seq, [token], [logprobs[i]] if k is not None else None,
                [list(zip(top_ids[i][:k], top_lps[i][:k]))] if k else None))
        return outputs

    def _resolve_verified(self, seq: Sequence, tokens: list[int],
                          logprobs: tuple | None = None) -> RequestOutput:
        """A verified step's tokens for ``seq`` (the proposals kept and one more), up to the
        first that ends it; the kept proposals' KV was computed in that step. ``logprobs``:
        theirs and their top ones, if asked."""
        reason = None
        for i, token in enumerate(tokens):
            if i == 0:
                seq.resolve_pending(token)
            else:
                seq.token_ids.append(token)
                seq.num_computed_tokens += 1
            if (reason := self._stop_reason(seq, token)) is None \
                    and self._grammar_ends(seq, token):
                seq.stop_reason, reason = token, FinishReason.STOP
            if reason is not None:
                tokens = tokens[:i + 1]
                break
        self.kv.commit(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        if logprobs is None:
            return self.output(seq, tokens, None)
        chosen, top = logprobs
        return self.output(seq, tokens, chosen[:len(tokens)],
                           top[:len(tokens)] if top is not None else None)

    def append(self, seq: Sequence, token: int) -> None:
        """A token sampled elsewhere (a prefill replica's first token, say)."""
        seq.token_ids.append(token)
        self._check_stop(seq, token)
        self._advance_grammar(seq, token)

    def output(self, seq: Sequence, new_tokens: list[int], new_logprobs: list[float] | None,
               new_top: list[TopLogprobs] | None = None) -> RequestOutput:
        prompt = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent and new_tokens:
            prompt, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return RequestOutput(
            seq.request_id, new_tokens, new_logprobs, seq.is_finished,
            seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
            seq.num_resolved_tokens - seq.num_prompt_tokens, seq.num_cached_tokens, new_top,
            prompt)

    def _advance_grammar(self, seq: Sequence, token: int) -> None:
        """A structured-output sequence's matcher takes its new token; a complete grammar (its
        end-of-sequence token taken) ends the sequence with ``stop``."""
        if self._grammar_ends(seq, token) and not seq.is_finished:
            seq.stop_reason = token
            self.scheduler.finish(seq, FinishReason.STOP)

    @staticmethod
    def _grammar_ends(seq: Sequence, token: int) -> bool:
        """``seq``'s matcher (if any) takes ``token``: whether that completes its grammar (or
        breaks it, which a mask that allowed the token makes an error: logged)."""
        m = seq.matcher
        if m is None or m.is_terminated():
            return False
        if not m.accept_token(token):  # the mask allowed it: only a token from elsewhere
            log.error("request %s: token %d breaks its grammar; stopping it", seq.request_id,
                      token)
            return True
        return m.is_terminated()

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if (reason := self._stop_reason(seq, token)) is not None:
            self.scheduler.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token: int, added: int = 0) -> FinishReason | None:
        """Whether ``token``, just added, ends ``seq`` (its ``stop_reason`` set where a token
        does); ``added`` 1: whether it would, were it added next (nothing set)."""
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            if not added:
                seq.stop_reason = token
            return FinishReason.STOP
        if (seq.num_output_tokens + added - seq.num_pending >= p.max_tokens
                or seq.num_resolved_tokens + added >= self.max_model_len):
            return FinishReason.LENGTH
        return None

    def may_end(self, seq: Sequence, token: int) -> bool:
        """Whether ``token``, added next, would end ``seq``, or might (a grammar decides)."""
        return seq.matcher is not None or self._stop_reason(seq, token, added=1) is not None


def _store_prompt_logprobs(p) -> None:
    lps = p.logprobs.tolist()
    ids = p.top_ids.tolist() if p.top_ids is not None else None
    vals = p.top_logprobs.tolist() if p.top_logprobs is not None else None
    for i, (seq, pos) in enumerate(p.owners):
        k = seq.params.prompt_logprobs
        seq.prompt_logprobs[pos] = [lps[i], [[t, v] for t, v in zip(ids[i][:k], vals[i][:k])]
                                    if k else []]
