"""What a step costs on the device, measured as the engine runs: the time of a step with no
prompt tokens, and what each prompt token adds to a step. A disaggregated app's decode replica
reads it to decide whether prefilling a prompt here would stretch its running streams' steps past
their inter-token target (decode_worker.placement).

Each step is timed from an event recorded before its launch to the event after its sampling (on
CUDA; the engine being one step ahead, the start event runs once the step before has, so the
span is this step's own device time). On the CPU, where a step runs as it is launched, the span
is the launch's wall time. Both figures are exponential moving averages.

What a prompt token adds is a prompt step's time over the fastest of the latest decode-only steps,
per prompt token: noise (a loaded host, a step that waited) only ever adds time, so the fastest
recent decode step is the cleanest reference, and a recent one follows the batch as it grows. A
prompt step measured no slower than that reference says nothing about its tokens (it is not a
cost of zero): it waits for a faster decode step, at most ``RECENT`` of them, and is then dropped.
"""

from __future__ import annotations

import time
from collections import deque

import torch

WEIGHT = 0.2  # of the newest sample in the moving averages
RECENT = 8  # decode-only steps a prompt step is compared with


class StepCost:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.decode_s: float | None = None  # a step with no prompt tokens
        self.prompt_token_s: float | None = None  # what one prompt token adds to a step
        self._recent: deque[float] = deque(maxlen=RECENT)  # the latest decode-only steps
        # prompt steps not yet measured above a decode step: (seconds, tokens, decode steps left)
        self._pending: deque[tuple[float, int, int]] = deque(maxlen=4)

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
            self._recent.append(seconds)
            pending, self._pending = list(self._pending), deque(maxlen=self._pending.maxlen)
            for step_s, tokens, left in pending:
                self._add_prompt(step_s, tokens, left - 1)
        else:
            self._add_prompt(seconds, prompt_tokens, RECENT)

    def _add_prompt(self, seconds: float, tokens: int, decode_steps_left: int) -> None:
        added = seconds - min(self._recent) if self._recent else 0.0
        if added > 0:
            self.prompt_token_s = _ema(self.prompt_token_s, added / tokens)
        elif decode_steps_left > 0:
            self._pending.append((seconds, tokens, decode_steps_left))

    def estimate(self, prompt_tokens: int) -> float | None:
        """Seconds of a step that also computes ``prompt_tokens`` (None until measured)."""
        if self.decode_s is None or self.prompt_token_s is None:
            return None
        return self.decode_s + prompt_tokens * self.prompt_token_s


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
