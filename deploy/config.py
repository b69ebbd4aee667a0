"""One config for the whole app, validated when the app is built.

    mode: disaggregated | colocated
    engine:   EngineConfig fields shared by every replica
    prefill:  replicas and resources of the prefill deployment
    decode:   replicas and resources of the decode deployment
    router:   the ingress (HTTP and gRPC)
    transfer: KV-transfer backend and deadline
    admission: when overload is refused (``retry_after_s``)
    disaggregation: where each request is prefilled (``mode``: auto, always, never;
              ``max_local_prefill_length``, ``itl_target_ms``, ``first_token_while_queued``)
A prefill:decode ratio change is ``prefill.num_replicas`` / ``decode.num_replicas``, or, with a
role's ``autoscaling_config`` (Ray Serve's fields; Baton's policies by default,
``deploy.autoscaling``), a range the load moves each pool in.

Admission: a replica holds at most ``max_ongoing_requests`` requests (default: four times its
engine's ``max_num_seqs`` for a decode replica, a running batch and three waiting in the engine,
where ``priority`` and the bounded wait apply; twice for a prefill replica); up to
``max_queued_requests`` more (default: one batch, ``max_num_seqs``) wait in Serve at each caller,
and the rest are refused at once: HTTP 429 with ``Retry-After``, gRPC ``RESOURCE_EXHAUSTED``.
Serve counts a request as queued until it is assigned to a replica, so a bound smaller than the
bursts you expect refuses some of a burst even with free replicas. A refused prefill call is
prefilled by the decode replica itself instead.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from decode_worker.placement import DisaggregationConfig
from engine.config import EngineConfig
from router.config import RouterConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoleConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0.0, ge=0)  # per rank: a replica of N ranks asks for N times this
    # Ranks each replica's model is split over (engine.parallel); None: the engine's setting.
    tensor_parallel_size: int | None = Field(None, ge=1)
    # None: 4 (decode) or 2 (prefill) x the engine's max_num_seqs
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=-1)  # None: max_num_seqs; -1: unbounded
    engine: dict = Field(default_factory=dict)  # per-role EngineConfig overrides
    # Placement (Ray's own): custom resources each replica needs (a node pool advertises them,
    # for example `ray start --resources='{"prefill_pool": 8}'`), an accelerator type ("H100"),
    # and node labels (`ray start --labels`). Empty: anywhere the CPUs and GPUs fit.
    resources: dict[str, float] = Field(default_factory=dict)
    accelerator_type: str | None = None
    label_selector: dict[str, str] = Field(default_factory=dict)
    # Ray Serve's autoscaling_config (min_replicas, max_replicas, initial_replicas, delays, ...);
    # without a "policy", the role's Baton policy (deploy/autoscaling.py) with its targets in
    # policy.policy_kwargs. None: a fixed num_replicas.
    autoscaling_config: dict | None = None

    @field_validator("autoscaling_config")
    @classmethod
    def _serve_autoscaling(cls, value: dict | None) -> dict | None:
        if value is not None:
            from ray.serve.config import AutoscalingConfig

            # Serve ignores keys it does not know: a misspelt one would pass unseen
            unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
            if unknown:
                raise ValueError(f"unknown autoscaling_config field(s) {unknown}; Ray Serve's "
                                 f"are {sorted(AutoscalingConfig.model_fields)}")
            AutoscalingConfig(**value)  # Serve's own check, now rather than at deploy time
        return value

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> "RoleConfig":
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas and autoscaling_config exclude each other: set "
                             "autoscaling_config.initial_replicas (or min_replicas) instead")
        return self

    def autoscaling(self, default_policy: str) -> dict | None:
        """Serve's autoscaling_config of the role: the role's Baton policy unless it names
        one."""
        if self.autoscaling_config is None:
            return None
        config = dict(self.autoscaling_config)
        policy = dict(config.get("policy") or {})  # its targets alone: still Baton's policy
        policy.setdefault("policy_function", default_policy)
        config["policy"] = policy
        return config

    def actor_options(self, ranks: int = 1) -> dict:
        """Ray options of one replica of ``ranks`` ranks: the replica's process holds every
        rank's GPU (its worker processes use the devices the replica sees), so they are on
        one node, as a STRICT_PACK placement would put them."""
        opts = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus * ranks}
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        if self.label_selector:
            opts["label_selector"] = dict(self.label_selector)
        return opts


class AdmissionConfig(_Strict):
    retry_after_s: float = Field(1.0, gt=0)  # the Retry-After of a refused request


class TransferConfig(_Strict):
    backend: Literal["auto", "local", "nixl", "nccl", "cuda_ipc"] = "auto"
    timeout_s: float = Field(30.0, gt=0)
    # Prefill replicas open their links to every decode replica as it appears (listed in Ray's
    # internal key-value store), so no request pays a link's first-push cost.
    warm_links: bool = True
    # A prefill replica starts a request's push as the step that prefilled it returns, on the
    # engine thread, and waits for node-local copies in its next poll (prefill_worker/server.py):
    # the answer leaves up to two steps sooner; off by default, see docs/serving.md.
    push_at_step_end: bool = False


# The engine settings that make up a KV block's layout (kvtransfer.KVLayout): two roles that
# differ in one of them cannot hand blocks over.
KV_LAYOUT_FIELDS = ("model", "dtype", "kv_cache_dtype", "block_size")


class BatonConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    prefill: RoleConfig = Field(default_factory=RoleConfig)
    decode: RoleConfig = Field(default_factory=RoleConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    # Where each request is prefilled (decode_worker/placement.py): auto (here when the uncached
    # part of the prompt is short or the prefill pool saturated), always, never
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)

    @model_validator(mode="after")
    def _check_policies(self) -> "BatonConfig":
        """A role's Baton policy is made with its ``policy_kwargs`` now (a target out of range,
        a misspelt one), not first in Serve's controller at deploy time."""
        from ray.serve.config import AutoscalingConfig

        from deploy.autoscaling import DECODE_POLICY, PREFILL_POLICY

        for role, default in (("prefill", PREFILL_POLICY), ("decode", DECODE_POLICY)):
            if (config := getattr(self, role).autoscaling(default)) is None:
                continue
            policy = AutoscalingConfig(**config).policy  # resolved as Serve's controller does
            if policy.policy_function in (PREFILL_POLICY, DECODE_POLICY):
                try:
                    policy.get_policy()(**policy.policy_kwargs)
                except (TypeError, ValueError) as exc:
                    raise ValueError(
                        f"{role}.autoscaling_config.policy.policy_kwargs: {exc}") from None
        return self

    @model_validator(mode="after")
    def _check_roles(self) -> "BatonConfig":
        for role in ("prefill", "decode") if self.mode == "disaggregated" else ("decode",):
            ranks = self.engine_for(role).tensor_parallel_size
            gpus = getattr(self, role).num_gpus
            if ranks > 1 and gpus and gpus != 1:
                raise ValueError(f"{role}.num_gpus: {gpus} per rank; a split model needs one "
                                 "whole GPU per rank")
        if self.mode == "disaggregated":  # the KV they hand over must mean the same on both
            prefill, decode = self.engine_for("prefill"), self.engine_for("decode")
            differ = [f"{f}: prefill {getattr(prefill, f)!r}, decode {getattr(decode, f)!r}"
                      for f in KV_LAYOUT_FIELDS if getattr(prefill, f) != getattr(decode, f)]
            if differ:
                raise ValueError("the prefill and decode roles must agree on the KV layout "
                                 "they hand over; " + "; ".join(differ))
        return self

    def engine_for(self, role: Literal["prefill", "decode"]) -> EngineConfig:
        rc = self.prefill if role == "prefill" else self.decode
        ranks = {} if rc.tensor_parallel_size is None else {
            "tensor_parallel_size": rc.tensor_parallel_size}
        # A prefill replica makes one token a request: speculation (and a draft model's weights
        # and cache) is the decode role's, unless the prefill role's own engine asks for it.
        role = {"speculative_config": None} if role == "prefill" else {}
        return EngineConfig(**{**self.engine.model_dump(), **ranks, **role, **rc.engine})

    def max_ongoing(self, role: Literal["prefill", "decode"]) -> int:
        """A decode replica holds a running batch and three waiting in its engine, where
        ``priority`` and the bounded wait order them (a request still in Serve's queue at the
        caller has neither: beside 128 long requests on the CPU config a short one, even of a
        better priority, waited there for its 429 at the first-token bound, with two batches
        held); a prefill replica a batch and one waiting."""
        cfg = self.prefill if role == "prefill" else self.decode
        batches = 2 if role == "prefill" else 4
        return cfg.max_ongoing_requests or batches * self.engine_for(role).max_num_seqs

    def max_queued(self, role: Literal["prefill", "decode"]) -> int:
        cfg = self.prefill if role == "prefill" else self.decode
        q = cfg.max_queued_requests
        return self.engine_for(role).max_num_seqs if q is None else q

    @property
    def served_model_name(self) -> str:
        return self.router.model_name or self.engine_for("decode").model
