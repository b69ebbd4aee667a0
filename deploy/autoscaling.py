"""Baton's autoscaling policies: Ray Serve's custom autoscaling policies for the two roles.

A role's ``autoscaling_config`` in the Baton config is Ray Serve's own (``min_replicas``,
``max_replicas``, ``initial_replicas``, ``upscale_delay_s``, ``downscale_delay_s``, ...); unless it
names a ``policy`` of its own, the role gets one of these, with its targets in
``policy.policy_kwargs``. Serve calls the policy on every autoscaling tick with an
``AutoscalingContext`` whose ``aggregated_metrics`` are what each replica reports
(``contracts.role.autoscaling_stats``: prompt tokens queued, KV-cache use, mean step time, tokens
computed per second of stepping), averaged over ``look_back_period_s``; Serve then applies the
delays and the bounds. A replica Serve retires drains first (its requests finish, or move as on
a death), and one waiting for a GPU that is not free delays no other.

- Prefill replicas (:class:`PrefillPolicy`): enough that the prompt tokens queued on them clear
  within ``target_ttft_s`` at their measured prefill rate (Dynamo's planner sizes prefill from
  its queue the same way); one while nothing is queued.
- Decode replicas (:class:`DecodePolicy`): the replicas times the load against its targets, the
  higher of the mean KV-cache use over ``target_kv_usage`` and the mean step time over
  ``target_itl_ms`` (Dynamo's load mode scales decode from KV use).

Stdlib only: Serve pickles a policy's module by value into its controller.
"""

from __future__ import annotations

import math

PREFILL_POLICY = "deploy.autoscaling:PrefillPolicy"
DECODE_POLICY = "deploy.autoscaling:DecodePolicy"


def _finite(values) -> list[float]:
    """The reports that are numbers (a NaN or an infinity is no measurement)."""
    return [v for v in values if v is not None and math.isfinite(v)]


def _mean(values) -> float | None:
    values = _finite(values)
    return sum(values) / len(values) if values else None


def _metric(ctx, name: str) -> dict:
    return (ctx.aggregated_metrics or {}).get(name, {})


class PrefillPolicy:
    """Prefill replicas from the prompt tokens queued on them and their measured rate."""

    def __init__(self, target_ttft_s: float = 1.0):
        if target_ttft_s <= 0:
            raise ValueError(f"target_ttft_s must be positive, not {target_ttft_s}")
        self.target_ttft_s = target_ttft_s

    def __call__(self, ctx) -> tuple[int, dict]:
        state = dict(ctx.policy_state or {})
        queued = sum(_finite(_metric(ctx, "queued_prompt_tokens").values()))
        rate = _mean(r for r in _metric(ctx, "tokens_per_step_second").values() if r > 0)
        if rate is not None:
            state["prefill_rate"] = rate  # remembered: an idle replica measures nothing
        rate = state.get("prefill_rate")
        if not queued:
            return 1, state
        if rate is None:  # work queued, no rate measured yet: as many as now
            return ctx.current_num_replicas, state
        return max(1, math.ceil(queued / (rate * self.target_ttft_s))), state


class DecodePolicy:
    """Decode replicas from KV-cache use and step time against their targets."""

    def __init__(self, target_kv_usage: float = 0.7, target_itl_ms: float = 50.0):
        if not 0 < target_kv_usage <= 1 or target_itl_ms <= 0:
            raise ValueError("target_kv_usage must be in (0, 1] and target_itl_ms positive, "
                             f"not {target_kv_usage} and {target_itl_ms}")
        self.target_kv_usage, self.target_itl_ms = target_kv_usage, target_itl_ms

    def __call__(self, ctx) -> tuple[int, dict]:
        state = dict(ctx.policy_state or {})
        kv = _mean(_metric(ctx, "kv_cache_usage").values())
        step = _mean(_metric(ctx, "step_ms").values())
        running = sum(_finite(_metric(ctx, "running").values())) + \
            sum(_finite(_metric(ctx, "waiting").values()))
        if kv is None:  # no report yet
            return ctx.current_num_replicas, state
        if not running:
            return 1, state
        load = max(kv / self.target_kv_usage,
                   (step or 0.0) / self.target_itl_ms)
        return max(1, math.ceil(ctx.current_num_replicas * load)), state
