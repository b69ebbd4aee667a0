"""The ingress deployment: OpenAI-compatible HTTP and gRPC in one Serve deployment.

Per request: validate → apply the chat template → tokenize → start it on a decode replica
(:class:`~router.ingress.streams.DecodeClient`; its tokens come back over the token channel, not
as Serve items) → detokenize and check stop strings as they arrive → SSE chunks, a JSON body, or
gRPC messages, each carrying every token that arrived since the previous one. Bad input is a 400
in OpenAI's error format (gRPC: INVALID_ARGUMENT); a request that cannot be served in time ends
with an error, never a silent hang.

The deployment holds the request service (:mod:`.service`) and its two adapters, :mod:`.http`
and :mod:`.grpc_api`, which only translate; it declares the routes and RPC methods (Serve finds
them on this class) and hands each to its adapter.
"""

import os

from ray import serve

from router.ingress.grpc_api import GrpcAdapter
from router.ingress.haproxy import HAProxyBound, node_paths
from router.ingress.http import HttpAdapter, app
from router.ingress.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, TokenizeRequest)
from router.ingress.service import RequestService, warn_if_open_without_key


def bind_direct_grpc(host: str) -> None:
    """Serve starts each ingress replica's own gRPC server (direct ingress, behind HAProxy) on
    every interface (``[::]:<port>``), where its HTTP server binds ``http_options.host``, and
    has no setting for it; bind it to ``host`` instead (called from the replica's constructor:
    Serve starts those servers once it has returned). A local cluster whose app listens on
    loopback sets ``BATON_GRPC_HOST`` (``deploy/ray_env.py``), so that no port of a one-machine
    app is open beyond the machine; a cluster (where HAProxy reaches replicas of other nodes)
    leaves it unset."""
    from ray.serve._private import default_impl

    add = default_impl.add_grpc_address
    if getattr(add, "baton_host", None) == host:
        return

    def add_on_host(server, address: str):
        if address.startswith("[::]:"):
            address = f"{host}:{address.rpartition(':')[2]}"
        return add(server, address)

    add_on_host.baton_host = host
    default_impl.add_grpc_address = add_on_host


# Serve's name for it stays "Router" (what `serve status`, the dashboards, the metrics' tags and
# process titles show); the classes that pick replicas are Serve request routers
# (router/replica_choice.py).
@serve.deployment(name="Router", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, decode, model: str, served_name: str, max_model_len: int | None,
                 config: dict | None = None, engine: dict | None = None, prefill=None):
        if host := os.environ.get("BATON_GRPC_HOST"):
            bind_direct_grpc(host)
        self.service = RequestService(decode, model, served_name, max_model_len, config, engine,
                                      fallback=prefill)
        self.http = HttpAdapter(self.service)
        self.grpc = GrpcAdapter(self.service)
        # HAProxy refuses beyond the app's bound itself, where its config lets it (.haproxy).
        self.haproxy_bound = HAProxyBound(self.service.pool_bound, self.service.retry_after_s,
                                          self.service.replica, node_paths())
        self.haproxy_bound.start()
        warn_if_open_without_key(self.service.api_key)

    # The HTTP routes (FastAPI through Serve binds ``self`` on this class's methods only).
    @app.get("/health")
    async def health(self):
        return await self.http.health()

    @app.get("/livez")
    async def livez(self):
        """Alive: this ingress replica answers, whatever the rest of the app does."""
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        return await self.http.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        return await self.http.model(model_id)

    @app.get("/metrics")
    async def metrics_endpoint(self):
        return await self.http.metrics()

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        return await self.http.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        return await self.http.detokenize(body)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self.http.completions(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self.http.chat(body)

    # The gRPC methods, by RPC name (``proto/baton.proto``).
    async def Generate(self, request, grpc_context):
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context):
        async for message in self.grpc.generate_stream(request, grpc_context):
            yield message

    async def Health(self, request, grpc_context=None):
        return await self.grpc.health(request, grpc_context)
