"""Where each request is prefilled: on this decode replica or by a prefill replica, decided per
request by the decode replica, which knows its own prefix cache (Dynamo's conditional
disaggregation: ``max_local_prefill_length``, and a prefill queue that is too long), and an
optional inter-token target.

Modes (``disaggregation.mode``):

- ``always``: every request with a prompt to compute is handed over (Baton before this);
- ``never``: every request is prefilled here (a disaggregated app run colocated, to compare);
- ``auto`` (the default): here when the part of the prompt the local prefix cache lacks is at
  most ``max_local_prefill_length`` tokens (a short prompt's hand-over costs more than its
  prefill chunk costs the running batch), or when the prefill pool looks saturated: the prompt
  tokens this replica has sent to prefill replicas and not yet had answered, at the rate their
  answers have come, would make the first token later than prefilling here behind the local
  queue, at the local prefill rate; handed over otherwise. With ``itl_target_ms`` set, a prompt
  these rules keep here is handed over instead (reason ``itl``) when this replica's step with
  its tokens in it would exceed the target (the engine's measured decode step plus each prompt
  token's measured cost, :mod:`engine.step_cost`): on a GPU that the prefill replica shares,
  prefilling here stretches every running stream's step, where a hand-over costs only this
  request's first token.

A prompt to be handed over that finds no room here (its blocks or a sequence slot short) is
queued here instead (reason ``no_room``); with ``first_token_while_queued`` (the default) a
prefill replica makes its first token meanwhile, published at once, so a full decode pool delays
the second token, not the first.

In every mode, once a prefill call has found its replica dead, prompts are prefilled here until
a prefill replica answers again (``prefill_down``): Serve goes on routing calls to a dead
replica for seconds, until its controller notices.

The rates are measured as requests go. The prefill pool's is its throughput for this replica:
prompt tokens answered over the time any call was outstanding (``BusyRate``), so calls served
together share their time; a per-call rate (tokens over each call's own time) reads N calls in a
burst as N times too slow, and, measured in a burst and never again once every prompt stays
here, kept a 1P1D app on an H200 from handing any 4k-token prompt over at 8 and 16 requests/s
(2026-11-26). A pool with nothing outstanding from this replica is never saturated. The local
rate is an exponential moving average of prompt tokens per second of local prefills, from
admission to the first token (slow in a burst, which only errs towards handing over). Until both
are known a long prompt is handed over. Every decision is counted and said in the request's
result and timeline (``where``, ``reason``).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.streamed import LOCAL, REMOTE, Placement


class DisaggregationConfig(BaseModel):
    """Where requests are prefilled in a disaggregated app (ignored by a colocated one)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "always", "never"] = "auto"
    # auto: prefill here when the uncached part of the prompt is at most this many tokens
    max_local_prefill_length: int = Field(1000, ge=0)
    # auto: also prefill here when the prefill pool's estimated first token is later than the
    # local one by this factor (1.0: as soon as it is later)
    saturation_factor: float = Field(1.0, gt=0)
    # auto: an inter-token target (ms). A prompt that the rules above would prefill here is
    # handed over instead when this replica's step, with that prompt's tokens in it, would take
    # longer (its decode step and each prompt token's cost, measured: engine.step_cost). None:
    # no target (Dynamo's rule alone).
    itl_target_ms: float | None = Field(None, gt=0)
    # A prompt to be handed over that finds no room here (blocks or sequence slots short) is
    # queued here; with this on, a prefill replica also makes its first token meanwhile, which
    # is published at once (vLLM's order: the first token does not wait for the decode side's
    # room). The prompt is computed here once room frees, as a preempted request's is.
    first_token_while_queued: bool = True


ALWAYS = DisaggregationConfig(mode="always")  # every prompt handed over (tests, tools)


class Rate:
    """Tokens per second, an exponential moving average (None until the first sample)."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.value = weight, None

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.value = rate if self.value is None else \
            (1 - self.weight) * self.value + self.weight * rate


class BusyRate:
    """Tokens per second a server delivers while it has work from us: tokens answered over the
    time anything was outstanding; busy time beyond ``horizon_s`` is forgotten in proportion
    (the newest ~10 s of work weigh)."""

    def __init__(self, horizon_s: float = 10.0):
        self.horizon_s = horizon_s
        self.outstanding = 0  # tokens sent, not answered yet
        self.busy_s = 0.0
        self.done = 0.0  # tokens answered within ``busy_s``
        self._t: float | None = None

    @property
    def value(self) -> float | None:
        return self.done / self.busy_s if self.done and self.busy_s > 0 else None

    def _advance(self, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        if self.outstanding > 0 and self._t is not None:
            self.busy_s += max(0.0, now - self._t)
        self._t = now

    def start(self, tokens: int, now: float | None = None) -> None:
        self._advance(now)
        self.outstanding += tokens

    def finish(self, tokens: int, delivered: bool = True, now: float | None = None) -> None:
        self._advance(now)
        self.outstanding = max(0, self.outstanding - tokens)
        if delivered:
            self.done += tokens
        if self.busy_s > self.horizon_s:
            keep = self.horizon_s / self.busy_s
            self.busy_s, self.done = self.horizon_s, self.done * keep


class Placer:
    """The decision and what it rests on. Called on the engine thread (the decision reads the
    engine's queue) and, for the rates and the outstanding tokens, from the event loop; the
    counters are plain numbers, written where they change."""

    def __init__(self, config: DisaggregationConfig | None = None):
        self.config = config or DisaggregationConfig()
        self.remote_rate, self.local_rate = BusyRate(), Rate()
        # A prefill replica died and none has answered since: every prompt is prefilled here
        # (set and cleared by the decode server's event loop, read in decide)
        self.prefill_down = False
        self.counts: dict[tuple[str, str], int] = {}

    def decide(self, uncached: int, local_queue: int, step_s: float | None = None
               ) -> Placement:
        """``uncached``: the prompt tokens the local prefix cache lacks; ``local_queue``: the
        prompt tokens already waiting to be prefilled here; ``step_s``: how long a step of
        this replica that computes them would take (None: not measured yet)."""
        mode, target = self.config.mode, self.config.itl_target_ms
        if self.prefill_down:
            placement = Placement(LOCAL, "prefill_down")
        elif mode != "auto":
            placement = Placement(LOCAL if mode == "never" else REMOTE, mode)
        elif target is not None and step_s is not None and step_s * 1e3 > target and (
                uncached <= self.config.max_local_prefill_length
                or self._saturated(uncached, local_queue)):
            placement = Placement(REMOTE, "itl")
        elif uncached <= self.config.max_local_prefill_length:
            placement = Placement(LOCAL, "short")
        elif self._saturated(uncached, local_queue):
            placement = Placement(LOCAL, "saturated")
        else:
            placement = Placement(REMOTE, "long")
        key = (placement.where, placement.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        return placement

    @property
    def remote_for_certain(self) -> bool:
        """Every prompt is handed over unless its blocks or a sequence slot are short here
        (``always``, no prefill replica known dead): nothing of the engine's state but its room
        bears on the decision, so the hand-over may be sent before the reservation."""
        return self.config.mode == "always" and not self.prefill_down

    @property
    def outstanding(self) -> int:
        """Prompt tokens sent to prefill replicas, not answered yet."""
        return self.remote_rate.outstanding

    def _saturated(self, uncached: int, local_queue: int) -> bool:
        remote, local = self.remote_rate.value, self.local_rate.value
        if remote is None or local is None or not self.outstanding:
            return False  # not measured yet, or nothing of ours waits there
        remote_s = (self.outstanding + uncached) / remote
        local_s = (local_queue + uncached) / local
        return remote_s > self.config.saturation_factor * local_s

    # -- what the decisions rest on ------------------------------------------------------------
    def sent(self, tokens: int, now: float | None = None) -> None:
        self.remote_rate.start(tokens, now)

    def answered(self, tokens: int, delivered: bool, now: float | None = None) -> None:
        """A remote prefill call ended (``delivered``: its prompt's KV came; a call that
        delivered nothing counts as time, not as tokens)."""
        self.remote_rate.finish(tokens, delivered, now)

    def prefilled_here(self, tokens: int, seconds: float) -> None:
        self.local_rate.add(tokens, seconds)
