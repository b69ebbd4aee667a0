"""The prefill Serve deployment (defaults here; the app config overrides them)."""

from __future__ import annotations

from ray import serve

from contracts.messages import FirstTokenRequest, GenerateRequest, PrefillRequest
from contracts.role import RoleDeployment
from engine import EngineConfig
from kvtransfer.directory import PeerDirectory
from prefill_worker.server import PrefillServer


@serve.deployment(name="PrefillServer", ray_actor_options={"num_cpus": 0.5},
                  max_ongoing_requests=64, health_check_period_s=10)
class PrefillDeployment(RoleDeployment):
    def __init__(self, engine: dict, backend: str, warm_links: bool = True,
                 push_at_step_end: bool = False):
        directory = PeerDirectory(serve.get_replica_context().app_name) if warm_links else None
        self.server = PrefillServer(EngineConfig(**engine), backend, directory, push_at_step_end)
        self.watch_engine()

    async def info(self):
        return self.server.info()

    async def prefill(self, req: PrefillRequest):
        return await self.server.prefill(req)

    async def first_token(self, req: FirstTokenRequest):
        return await self.server.first_token(req)

    async def generate(self, req: GenerateRequest) -> None:
        """A whole request, decoded here while no decode replica answers the ingress; like the
        decode deployment's, its tokens and result go to ``req.reply_to``."""
        await self.server.generate(req)
