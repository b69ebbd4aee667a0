"""Seeded workloads for the load tests; nothing is downloaded.

Every workload is a list of ``LoadRequest`` fixed in advance, so the same seed gives the same
requests on every machine and an open-loop run never waits on an answer to build the next
request. Kinds:

    fixed          every prompt ``input_len`` tokens, every output ``output_len`` tokens
    uniform        lengths drawn uniformly from [input_min, input_max] / [output_min, output_max]
    shared-prefix  ``num_prefixes`` long system prompts (``prefix_len`` tokens), each request one
                   of them followed by its own ``input_len - prefix_len`` tokens
    multi-turn     chats of ``turns`` turns: a system prompt, then per turn a user message of
                   ``input_len`` tokens; the prompt of turn k repeats turn k-1's prompt and a
                   (synthetic, seeded) assistant reply of ``output_len`` tokens, so the prefix
                   cache sees what a real chat gives it

Prompts are token ids for models without a tokenizer (``dummy:``) and text where one exists
(``tiny``, checkpoint folders): see ``TokenIdPrompts``, ``TextPrompts`` and ``prompt_maker``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Words text prompts are made of: plain, short, and tokenized much the same by any BPE.
WORDS = ("the of and to in is was for on that with as by at from his her an be are this had not "
         "but what all were when we there can more if no out so said time up about into than "
         "them only new some could these two may first then do any like my now over such our "
         "man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against "
         "go came right used take three river stone light engine paper green window garden").split()


@dataclass(frozen=True)
class LoadRequest:
    """One request of a workload. Exactly one of ``prompt`` (completions: text or token ids) and
    ``messages`` (chat, text models only) is set; ``max_tokens`` is what the client asks for and
    counts on (``ignore_eos`` is always sent)."""

    index: int
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    group: str = ""  # the shared prefix or the conversation this request belongs to
    prompt_len: int = 0  # prompt tokens as generated (chat: without the template)

    def flat_prompt(self) -> str | list[int]:
        """The prompt for an endpoint without chat (gRPC): messages joined as plain text."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, line: str) -> "LoadRequest":
        return cls(**json.loads(line))


class PromptMaker(Protocol):
    """Makes prompt pieces of a given token length and joins them."""

    def piece(self, rng: random.Random, num_tokens: int) -> str | list[int]: ...

    def join(self, pieces: list) -> str | list[int]: ...

    def count(self, prompt: str | list[int]) -> int: ...


@dataclass(frozen=True)
class TokenIdPrompts:
    """Token-id prompts drawn uniformly from ``[low, vocab_size)``; ``low`` keeps clear of the
    special tokens at the start of most vocabularies."""

    vocab_size: int
    low: int = 10

    def __post_init__(self):
        if self.vocab_size <= self.low + 1:
            raise ValueError(f"vocab_size: {self.vocab_size} leaves no token ids above {self.low}")

    def piece(self, rng: random.Random, num_tokens: int) -> list[int]:
        return [rng.randrange(self.low, self.vocab_size) for _ in range(num_tokens)]

    def join(self, pieces: list) -> list[int]:
        return [t for p in pieces for t in p]

    def count(self, prompt) -> int:
        return len(prompt)


@dataclass(frozen=True)
class TextPrompts:
    """Text prompts of random words, cut to ``num_tokens`` tokens of ``tokenizer`` (anything with
    ``encode(text, add_special_tokens=False)`` and ``decode(ids)``). Lengths are exact up to
    how the server's tokenizer splits the joins (a token or so)."""

    tokenizer: object = field(repr=False)

    def piece(self, rng: random.Random, num_tokens: int) -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens + 8))
        ids = self.tokenizer.encode(words, add_special_tokens=False)
        while len(ids) < num_tokens:  # a tokenizer that merges several words into one token
            words += " " + " ".join(rng.choice(WORDS) for _ in range(num_tokens))
            ids = self.tokenizer.encode(words, add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens]).strip()

    def join(self, pieces: list) -> str:
        return "\n".join(pieces)

    def count(self, prompt) -> int:
        return len(self.tokenizer.encode(prompt, add_special_tokens=False))


Kind = Literal["fixed", "uniform", "shared-prefix", "multi-turn"]


class WorkloadSpec(BaseModel):
    """What to generate. Unset ranges default to ``input_len``/``output_len`` ± 50%; an unset
    ``prefix_len`` to three quarters of ``input_len``."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind = "fixed"
    num_requests: int = Field(64, ge=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(128, ge=1)
    input_min: int | None = Field(None, ge=1)
    input_max: int | None = Field(None, ge=1)
    output_min: int | None = Field(None, ge=1)
    output_max: int | None = Field(None, ge=1)
    num_prefixes: int = Field(4, ge=1)
    prefix_len: int | None = Field(None, ge=1)
    turns: int = Field(4, ge=1)
    conversations_in_flight: int = Field(8, ge=1)
    chat: bool = True  # multi-turn on a text model: /v1/chat/completions with messages
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "WorkloadSpec":
        for which in ("input", "output"):
            lo, hi = self.range(f"{which}_len")
            if lo > hi:
                raise ValueError(f"{which}_min/{which}_max: empty range [{lo}, {hi}]")
        if self.kind == "shared-prefix" and self.shared_prefix_len() >= self.input_len:
            raise ValueError(f"prefix_len: {self.shared_prefix_len()} leaves no tokens of "
                             f"input_len={self.input_len} to the request itself")
        return self

    def range(self, which: Literal["input_len", "output_len"]) -> tuple[int, int]:
        base = getattr(self, which)
        stem = which.split("_")[0]
        lo, hi = getattr(self, f"{stem}_min"), getattr(self, f"{stem}_max")
        return (lo if lo is not None else max(1, base // 2),
                hi if hi is not None else max(1, base + base // 2))

    def shared_prefix_len(self) -> int:
        return self.prefix_len if self.prefix_len is not None else (3 * self.input_len) // 4


def _fixed(spec: WorkloadSpec, maker: PromptMaker, rng: random.Random) -> list[LoadRequest]:
    return [_completion(i, maker, maker.piece(rng, spec.input_len), spec.output_len)
            for i in range(spec.num_requests)]


def _uniform(spec: WorkloadSpec, maker: PromptMaker, rng: random.Random) -> list[LoadRequest]:
    (ilo, ihi), (olo, ohi) = spec.range("input_len"), spec.range("output_len")
    return [_completion(i, maker, maker.piece(rng, rng.randint(ilo, ihi)), rng.randint(olo, ohi))
            for i in range(spec.num_requests)]


def _shared_prefix(spec: WorkloadSpec, maker: PromptMaker,
                   rng: random.Random) -> list[LoadRequest]:
    plen = spec.shared_prefix_len()
    prefixes = [maker.piece(rng, plen) for _ in range(spec.num_prefixes)]
    out = []
    for i in range(spec.num_requests):
        which = rng.randrange(spec.num_prefixes)
        prompt = maker.join([prefixes[which], maker.piece(rng, spec.input_len - plen)])
        out.append(_completion(i, maker, prompt, spec.output_len, group=f"prefix{which}"))
    return out


def _multi_turn(spec: WorkloadSpec, maker: PromptMaker, rng: random.Random) -> list[LoadRequest]:
    """Conversations in waves of ``conversations_in_flight``: turn 1 of each, then turn 2 of
    each, ...; so turn k of a chat is sent well after turn k-1 of it."""
    chat = spec.chat and isinstance(maker, TextPrompts)
    out: list[LoadRequest] = []
    conv = 0
    while len(out) < spec.num_requests:
        wave = [[{"role": "system", "content": maker.piece(rng, spec.input_len)}]
                for _ in range(spec.conversations_in_flight)]
        for _turn in range(spec.turns):
            for c, history in enumerate(wave):
                if len(out) == spec.num_requests:
                    return out
                history.append({"role": "user", "content": maker.piece(rng, spec.input_len)})
                group = f"chat{conv + c}"
                if chat:
                    out.append(LoadRequest(len(out), spec.output_len,
                                           messages=[dict(m) for m in history], group=group,
                                           prompt_len=sum(maker.count(m["content"])
                                                          for m in history)))
                else:
                    prompt = maker.join([m["content"] for m in history])
                    out.append(_completion(len(out), maker, prompt, spec.output_len, group))
                history.append({"role": "assistant",
                                "content": maker.piece(rng, spec.output_len)})
        conv += len(wave)
    return out


def _completion(index: int, maker: PromptMaker, prompt, max_tokens: int,
                group: str = "") -> LoadRequest:
    return LoadRequest(index, max_tokens, prompt=prompt, group=group,
                       prompt_len=maker.count(prompt))


_BUILDERS = {"fixed": _fixed, "uniform": _uniform, "shared-prefix": _shared_prefix,
             "multi-turn": _multi_turn}


def build(spec: WorkloadSpec, maker: PromptMaker) -> list[LoadRequest]:
    """The workload ``spec`` describes, made of ``maker``'s prompts (same spec, same requests)."""
    return _BUILDERS[spec.kind](spec, maker, random.Random(spec.seed))


def prompt_maker(model: str, prompt_format: Literal["auto", "ids", "text"] = "auto"):
    """Token ids for a model without a tokenizer, text otherwise (``auto``). Reads the model's
    config and tokenizer files only; no weights are loaded."""
    from engine.model_source import load_tokenizer, resolve_model

    source = resolve_model(model)
    tokenizer = load_tokenizer(source) if prompt_format != "ids" else None
    if prompt_format == "text" and tokenizer is None:
        raise ValueError(f"prompt_format: model {model!r} has no tokenizer; use token ids")
    if tokenizer is not None:
        return TextPrompts(tokenizer)
    return TokenIdPrompts(source.config.vocab_size)


def arrival_times(rate: float, duration_s: float, process: Literal["poisson", "constant"],
                  seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of an open-loop run at ``rate`` requests/s for
    ``duration_s``: exponential gaps (a Poisson process) or equal gaps, fixed by ``seed``."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    if process == "constant":
        return [i / rate for i in range(math.ceil(rate * duration_s - 1e-9))]
    if process != "poisson":
        raise ValueError(f"arrival: {process!r} is not 'poisson' or 'constant'")
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


def arrival_offsets(rate: float, n: int, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests at a Poisson ``rate``, fixed by
    ``seed`` (``benchmarks.serving_bench --rate``, and the planner's replay of it)."""
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


def long_prompts(spec: str | None, n: int) -> dict[int, int]:
    """``FRACTION:TOKENS`` (``serving_bench --long-prompts``): every round(1/FRACTION)-th of
    ``n`` prompts has TOKENS tokens; ``{index: tokens}`` of those, in order."""
    if not spec:
        return {}
    fraction, tokens = spec.split(":")
    k = max(1, round(1 / float(fraction)))
    return {i: int(tokens) for i in range(k - 1, n, k)}


def save(requests: list[LoadRequest], path: Path) -> None:
    Path(path).write_text("".join(r.to_json() + "\n" for r in requests))


def load(path: Path) -> list[LoadRequest]:
    lines = Path(path).read_text().splitlines()
    requests = [LoadRequest.from_json(line) for line in lines if line.strip()]
    if not requests:
        raise ValueError(f"workload file {path} holds no requests")
    return requests
