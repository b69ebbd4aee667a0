"""The decode Serve deployment (defaults here; the app config overrides them)."""

from __future__ import annotations

import ray
from ray import serve

from contracts.messages import GenerateRequest
from contracts.role import RoleDeployment
from decode_worker.placement import DisaggregationConfig
from decode_worker.server import DecodeServer
from engine import EngineConfig
from kvtransfer.directory import PeerDirectory


@serve.deployment(name="DecodeServer", ray_actor_options={"num_cpus": 0.5},
                  max_ongoing_requests=256, health_check_period_s=10)
class DecodeDeployment(RoleDeployment):
    def __init__(self, engine: dict, backend: str, prefill=None,
                 transfer_timeout_s: float = 30.0, warm_links: bool = True,
                 disaggregation: dict | None = None, early_start: bool = True):
        """``early_start``: the app's ``router.early_start``, which also sends each hand-over
        to its prefill replica ahead of the call."""
        directory = (PeerDirectory(serve.get_replica_context().app_name)
                     if warm_links and prefill is not None else None)
        self.server = DecodeServer(EngineConfig(**engine), backend, prefill, transfer_timeout_s,
                                   directory, DisaggregationConfig(**(disaggregation or {})),
                                   ray.util.get_node_ip_address(), early_start)
        self.watch_engine()

    async def generate(self, req: GenerateRequest) -> None:
        """Runs the request to its end; its tokens, then its result (or the refusal of bad
        input only a replica can check), go to ``req.reply_to``: the answer's one path back.
        The call itself returns nothing; it raises when the server fails."""
        await self.server.generate(req)

