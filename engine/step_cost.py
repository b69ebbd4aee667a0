"""What a step costs on the device, measured as the engine runs: the time of a step with no
prompt tokens, and what each prompt token adds to a step. A disaggregated app's decode replica
reads it to decide whether prefilling a prompt here would stretch its running streams' steps past
their inter-token target (decode_worker.placement).

Each step is timed from an event recorded before its launch to the event after its sampling (on
CUDA; the engine being one step ahead, the start event runs once the step before has, so the
span is this step's own device time). On the CPU, where a step runs as it is launched, the span
is the launch's wall time. Both figures are exponential moving averages; the prompt tokens' cost
is the step's time over the latest decode-only step's, per prompt token.
"""

from __future__ import annotations

import time

import torch

WEIGHT = 0.2  # of the newest sample in the moving averages


class StepCost:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.decode_s: float | None = None  # a step with no prompt tokens
        self.prompt_token_s: float | None = None  # what one prompt token adds to a step
        self._first: tuple[float, int] | None = None  # a prompt step before any decode step

    def mark(self):
        """A mark before or after a step's launch (a CUDA event, or the wall clock)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record(self, start, end, prompt_tokens: int) -> None:
        """A step's span and the prompt tokens it computed (skipped on CUDA unless ``end`` has
        fired: a step that samples nothing is not waited for)."""
        if self.cuda and not end.query():
            return
        self._add(start.elapsed_time(end) / 1e3 if self.cuda else end - start, prompt_tokens)

    def _add(self, seconds: float, prompt_tokens: int) -> None:
        if prompt_tokens == 0:
            self.decode_s = _ema(self.decode_s, seconds)
            if self._first is not None:  # the prompt steps before any decode step
                self._add(*self._first)
        elif self.decode_s is None:
            self._first = (seconds, prompt_tokens)
        else:
            self._first = None
            per_token = max(0.0, seconds - self.decode_s) / prompt_tokens
            self.prompt_token_s = _ema(self.prompt_token_s, per_token)

    def estimate(self, prompt_tokens: int) -> float | None:
        """Seconds of a step that also computes ``prompt_tokens`` (None until measured)."""
        if self.decode_s is None or self.prompt_token_s is None:
            return None
        return self.decode_s + prompt_tokens * self.prompt_token_s


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
