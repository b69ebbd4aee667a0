"""Where each request is prefilled: on this decode replica or by a prefill replica, decided per
request by the decode replica, which knows its own prefix cache (Dynamo's conditional
disaggregation: ``max_local_prefill_length``, and a prefill queue that is too long).

Modes (``disaggregation.mode``):

- ``always``: every request with a prompt to compute is handed over (Baton before this);
- ``never``: every request is prefilled here (a disaggregated app run colocated, to compare);
- ``auto`` (the default): here when the part of the prompt the local prefix cache lacks is at
  most ``max_local_prefill_length`` tokens (a short prompt's hand-over costs more than its
  prefill chunk costs the running batch), or when the prefill pool looks saturated: the prompt
  tokens this replica has sent to prefill replicas and not yet had answered, at the rate their
  answers have come, would make the first token later than prefilling here behind the local
  queue, at the local prefill rate; handed over otherwise.

In every mode, once a prefill call has found its replica dead, prompts are prefilled here until
a prefill replica answers again (``prefill_down``): Serve goes on routing calls to a dead
replica for seconds, until its controller notices.

The rates are measured as requests go (exponential moving averages of prompt tokens per second
of each remote prefill call, from the call to its answer, and of local prefills, from
admission to the first token); until both are known a long prompt is handed over. Every
decision is counted and said in the request's result and timeline (``where``, ``reason``).
"""

from __future__ import annotations

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


class Placer:
    """The decision and what it rests on. Called on the engine thread (the decision reads the
    engine's queue) and, for the rates and the outstanding tokens, from the event loop; the
    counters are plain numbers, written where they change."""

    def __init__(self, config: DisaggregationConfig | None = None):
        self.config = config or DisaggregationConfig()
        self.remote_rate, self.local_rate = Rate(), Rate()
        self.outstanding = 0  # prompt tokens sent to prefill replicas, not answered yet
        # A prefill replica died and none has answered since: every prompt is prefilled here
        # (set and cleared by the decode server's event loop, read in decide)
        self.prefill_down = False
        self.counts: dict[tuple[str, str], int] = {}

    def decide(self, uncached: int, local_queue: int) -> Placement:
        """``uncached``: the prompt tokens the local prefix cache lacks; ``local_queue``: the
        prompt tokens already waiting to be prefilled here."""
        mode = self.config.mode
        if self.prefill_down:
            placement = Placement(LOCAL, "prefill_down")
        elif mode != "auto":
            placement = Placement(LOCAL if mode == "never" else REMOTE, mode)
        elif uncached <= self.config.max_local_prefill_length:
            placement = Placement(LOCAL, "short")
        elif self._saturated(uncached, local_queue):
            placement = Placement(LOCAL, "saturated")
        else:
            placement = Placement(REMOTE, "long")
        key = (placement.where, placement.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        return placement

    def _saturated(self, uncached: int, local_queue: int) -> bool:
        remote, local = self.remote_rate.value, self.local_rate.value
        if remote is None or local is None:
            return False
        remote_s = (self.outstanding + uncached) / remote
        local_s = (local_queue + uncached) / local
        return remote_s > self.config.saturation_factor * local_s

    # -- what the decisions rest on ------------------------------------------------------------
    def sent(self, tokens: int) -> None:
        self.outstanding += tokens

    def answered(self, tokens: int, seconds: float | None) -> None:
        """A remote prefill call ended (``seconds`` from call to answer; None: it delivered
        nothing, so it says nothing of the rate)."""
        self.outstanding = max(0, self.outstanding - tokens)
        if seconds is not None:
            self.remote_rate.add(tokens, seconds)

    def prefilled_here(self, tokens: int, seconds: float) -> None:
        self.local_rate.add(tokens, seconds)
