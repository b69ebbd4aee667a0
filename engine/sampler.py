"""Batched sampling without a host sync per request.

Greedy rows take the argmax. Other rows are scaled by temperature, cut by top-k and top-p, and
sampled with the exponential trick (``argmax(probs / q)``, ``q ~ Exp(1)``), drawing ``q`` from the
engine's generator, or for a request with a seed from its own generator seeded by
(seed, position of the token being sampled): a seeded request draws the same numbers however it
is batched, split between a prefill and a decode engine, or resumed on another replica with its
tokens so far as the prompt. Per-row parameters go to the device without a host sync
(:mod:`engine.uploads`), so sampling queues behind the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.sampling_params import SamplingParams
from engine.uploads import upload

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for the token at ``position`` (its index in prompt +
    output): splitmix64 of the pair, so neighbouring positions and seeds draw unrelated noise."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def new_generator(self) -> torch.Generator:
        """A seeded request's generator (re-seeded for each draw by :func:`position_seed`)."""
        return torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, params: Seq[SamplingParams],
                 generators: Seq[torch.Generator | None],
                 positions: Seq[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logits``: ``[B, V]`` float32; ``positions``: the index in prompt + output of each
        row's token → (token ids ``[B]``, logprobs ``[B]`` or None)."""
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy_ids
        else:
            tokens = torch.where(self._greedy_mask(params, logits.device), greedy_ids,
                                 self._sample(logits, params, generators, positions))
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs

    @staticmethod
    def _greedy_mask(params, device) -> torch.Tensor:
        return upload([p.greedy for p in params], torch.bool, device)

    def _sample(self, logits, params, generators, positions) -> torch.Tensor:
        temps = upload([p.temperature if p.temperature > 0 else 1.0 for p in params],
                       torch.float32, logits.device).to(logits.dtype)
        logits = logits / temps[:, None]
        logits = _apply_top_k(logits, [p.top_k for p in params])
        logits = _apply_top_p(logits, [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                gen.manual_seed(position_seed(params[i].seed, positions[i]))
                q[i].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks):
        return logits
    k_t = upload(ks, torch.int64, logits.device)
    kth = logits.topk(max(ks), dim=-1).values.gather(1, (k_t - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_p):
        return logits
    p_t = upload(top_p, torch.float32, logits.device).to(logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first token always stays).
    drop = (probs.cumsum(dim=-1) - probs) >= p_t[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
