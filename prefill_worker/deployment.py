"""The prefill Serve deployment (defaults here; the app config overrides them)."""

from __future__ import annotations

from dataclasses import asdict

from ray import serve

from contracts.messages import PrefillRequest
from engine import EngineConfig
from kvtransfer.directory import PeerDirectory
from prefill_worker.server import PrefillServer


@serve.deployment(name="PrefillServer", ray_actor_options={"num_cpus": 0.5},
                  max_ongoing_requests=64, health_check_period_s=10)
class PrefillDeployment:
    def __init__(self, engine: dict, backend: str, warm_links: bool = True):
        directory = PeerDirectory(serve.get_replica_context().app_name) if warm_links else None
        self.server = PrefillServer(EngineConfig(**engine), backend, directory)

    async def info(self):
        return self.server.info()

    async def kv_load(self) -> dict:
        return self.server.kv_load()

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (benchmarks replaying prompts)."""
        return await self.server.aengine.call(lambda engine: engine.reset_prefix_cache())

    async def engine_stats(self) -> dict:
        """The engine's step counters (:class:`engine.llm_engine.EngineStats`)."""
        return asdict(self.server.aengine.engine.stats)

    async def prefill(self, req: PrefillRequest):
        return await self.server.prefill(req)

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.close()

    def check_health(self) -> None:
        self.server.aengine.check()  # the engine thread, and every rank of a split model
