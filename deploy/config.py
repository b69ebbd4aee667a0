"""One config for the whole app, validated when the app is built.

    mode: disaggregated | colocated
    engine:   EngineConfig fields shared by every replica
    prefill:  replicas and resources of the prefill deployment
    decode:   replicas and resources of the decode deployment
    router:   the ingress (HTTP and gRPC)
    transfer: KV-transfer backend and deadline
A prefill:decode ratio change is ``prefill.num_replicas`` / ``decode.num_replicas``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config import EngineConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoleConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    engine: dict = Field(default_factory=dict)  # per-role EngineConfig overrides


class RouterConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.25, ge=0)
    model_name: str | None = None  # the name served in /v1/models (default: the model spec)
    request_timeout_s: float = Field(300.0, gt=0)
    max_tokens_default: int = Field(16, ge=1)


class TransferConfig(_Strict):
    backend: Literal["auto", "local", "nixl", "nccl", "cuda_ipc"] = "auto"
    timeout_s: float = Field(30.0, gt=0)


class BatonConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    prefill: RoleConfig = Field(default_factory=RoleConfig)
    decode: RoleConfig = Field(default_factory=RoleConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)

    def engine_for(self, role: Literal["prefill", "decode"]) -> EngineConfig:
        overrides = (self.prefill if role == "prefill" else self.decode).engine
        return EngineConfig(**{**self.engine.model_dump(), **overrides})

    @property
    def served_model_name(self) -> str:
        return self.router.model_name or self.engine.model
