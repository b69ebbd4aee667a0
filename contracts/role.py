"""What the prefill and decode deployments share: the Serve methods every role replica answers
(its load, its engine's counters, a prefix-cache reset, its health) and the load report they
are built from. Each role's server (``self.server``) runs its engine on an
:class:`engine.async_engine.AsyncEngine`; these read only the snapshot that engine's thread
publishes (``aengine.feed``), never the engine itself."""

from __future__ import annotations

from dataclasses import asdict


def load_report(aengine, endpoint) -> dict:
    """A role replica's KV load, for the request routers and benchmarks."""
    snap = aengine.feed.latest
    return {"used_blocks": snap.kv_blocks_used, "free_blocks": snap.kv_blocks_free,
            "held_blocks": endpoint.held_blocks if endpoint is not None else 0,
            "hit_rate": snap.hit_rate, "output_tokens": snap.stats.output_tokens,
            "endpoint_id": endpoint.endpoint_id if endpoint is not None else None,
            "node_id": endpoint.node_id if endpoint is not None else None}


class RoleDeployment:
    """Mixed into both role deployments (their server in ``self.server``)."""

    server = None

    async def kv_load(self) -> dict:
        return self.server.kv_load()

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (benchmarks replaying prompts)."""
        return await self.server.aengine.call(lambda engine: engine.reset_prefix_cache())

    async def engine_stats(self) -> dict:
        """The engine's step counters (:class:`engine.llm_engine.EngineStats`) after its
        latest step."""
        return asdict(self.server.aengine.feed.latest.stats)

    def check_health(self) -> None:
        self.server.aengine.check()  # the engine thread, and every rank of a split model

    def __del__(self):
        if self.server is not None:
            self.server.close()
