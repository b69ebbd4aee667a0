"""What the prefill and decode deployments share: the Serve methods every role replica answers
(its load, its engine's counters, a prefix-cache reset, its health) and the load report they
are built from. Each role's server (``self.server``) runs its engine on an
:class:`engine.async_engine.AsyncEngine`; these read only the snapshot that engine's thread
publishes (``aengine.feed``), never the engine itself."""

from __future__ import annotations

import time
from dataclasses import asdict


def load_report(aengine, endpoint) -> dict:
    """A role replica's KV load, for the request routers and benchmarks."""
    snap = aengine.feed.latest
    return {"used_blocks": snap.kv_blocks_used, "free_blocks": snap.kv_blocks_free,
            "held_blocks": endpoint.held_blocks if endpoint is not None else 0,
            "hit_rate": snap.hit_rate, "output_tokens": snap.stats.output_tokens,
            "endpoint_id": endpoint.endpoint_id if endpoint is not None else None,
            "node_id": endpoint.node_id if endpoint is not None else None}


def autoscaling_stats(snap, previous: tuple | None) -> tuple[dict, tuple]:
    """What a role replica reports to Serve's autoscaler (``deploy.autoscaling``) from its
    engine's snapshot: prompt tokens queued, KV-cache use, and over the interval since
    ``previous`` (``(time, stats)``) the mean step time and the tokens computed per second of
    stepping (a prefill replica's prefill rate). Returns the report and the new ``previous``."""
    now, stats = time.monotonic(), snap.stats
    report = {"queued_prompt_tokens": float(snap.queued_prompt_tokens),
              "kv_cache_usage": snap.kv_cache_usage, "running": float(snap.running),
              "waiting": float(snap.waiting)}
    if previous is not None:
        _, before = previous
        steps = stats.steps - before.steps
        seconds = stats.step_seconds - before.step_seconds
        if steps > 0 and seconds > 0:
            report["step_ms"] = seconds / steps * 1e3
            report["tokens_per_step_second"] = (stats.scheduled_tokens
                                                - before.scheduled_tokens) / seconds
    return report, (now, stats)


class RoleDeployment:
    """Mixed into both role deployments (their server in ``self.server``)."""

    server = None
    _autoscaling_previous = None

    async def kv_load(self) -> dict:
        return self.server.kv_load()

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (benchmarks replaying prompts)."""
        return await self.server.aengine.call(lambda engine: engine.reset_prefix_cache())

    async def engine_stats(self) -> dict:
        """The engine's step counters (:class:`engine.llm_engine.EngineStats`) after its
        latest step."""
        return asdict(self.server.aengine.feed.latest.stats)

    async def record_autoscaling_stats(self) -> dict:
        """Serve's autoscaler asks every replica for these (read by the policies in
        ``deploy.autoscaling``); from the engine's published snapshot only."""
        report, self._autoscaling_previous = autoscaling_stats(
            self.server.aengine.feed.latest, self._autoscaling_previous)
        return report

    def check_health(self) -> None:
        self.server.aengine.check()  # the engine thread, and every rank of a split model

    def __del__(self):
        if self.server is not None:
            self.server.close()
