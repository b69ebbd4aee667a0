"""The app builder: ``serve deploy`` / ``serve run deploy.app:build_app`` call ``build_app`` with
the config's ``args``; it validates them (``BatonConfig``) and returns the bound application:
the ingress (Serve name ``Router``) → DecodeServer (→ PrefillServer in disaggregated mode)."""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application

from deploy import ray_env
from deploy.autoscaling import DECODE_POLICY, PREFILL_POLICY
from deploy.config import BatonConfig, RoleConfig


ROUTER = "router.replica_choice:KVAwareRouter"  # both pools


def _backpressure(cfg: BatonConfig):
    from ray.serve.config import BackpressureConfig

    return BackpressureConfig(status_code=429, retry_after_s=cfg.admission.retry_after_s)


def _options(cfg: BatonConfig, role: str, router_class: str, **router_kwargs) -> dict:
    from ray.serve.config import RequestRouterConfig

    rc: RoleConfig = getattr(cfg, role)
    autoscaling = rc.autoscaling(PREFILL_POLICY if role == "prefill" else DECODE_POLICY)
    scale = ({"num_replicas": rc.num_replicas} if autoscaling is None else
             {"autoscaling_config": autoscaling})
    return dict(**scale, max_ongoing_requests=cfg.max_ongoing(role),
                max_queued_requests=cfg.max_queued(role), backpressure_config=_backpressure(cfg),
                ray_actor_options=rc.actor_options(cfg.engine_for(role).tensor_parallel_size),
                request_router_config=RequestRouterConfig(
                    request_router_class=router_class, request_router_kwargs=router_kwargs,
                    request_routing_stats_period_s=1.0))


def build_app(args: dict[str, Any] | BatonConfig | None = None) -> Application:
    from decode_worker.deployment import DecodeDeployment
    from prefill_worker.deployment import PrefillDeployment
    from router.ingress.app import Ingress

    cfg = args if isinstance(args, BatonConfig) else BatonConfig(**(args or {}))
    ray_env.warn_if_unconfigured(logging.getLogger("ray.serve"))
    backend = cfg.transfer.backend  # auto: chosen per replica pair at each push
    prefill = None
    if cfg.mode == "disaggregated":
        prefill = PrefillDeployment.options(**_options(
            cfg, "prefill", ROUTER, block_size=cfg.engine_for("prefill").block_size)).bind(
            cfg.engine_for("prefill").model_dump(), backend, cfg.transfer.warm_links,
            cfg.transfer.push_at_step_end)
    decode = DecodeDeployment.options(**_options(
        cfg, "decode", ROUTER, block_size=cfg.engine_for("decode").block_size)).bind(
        cfg.engine_for("decode").model_dump(), backend, prefill, cfg.transfer.timeout_s,
        cfg.transfer.warm_links, cfg.disaggregation.model_dump(), cfg.router.early_start)
    router = Ingress.options(num_replicas=cfg.router.num_replicas,
                            max_ongoing_requests=cfg.router.max_ongoing_requests,
                            max_queued_requests=cfg.router.max_queued_requests,
                            backpressure_config=_backpressure(cfg),
                            ray_actor_options={"num_cpus": cfg.router.num_cpus})
    engine = cfg.engine_for("decode")
    router_cfg = {**cfg.router.model_dump(), "retry_after_s": cfg.admission.retry_after_s,
                  "decode_max_ongoing": cfg.max_ongoing("decode"),
                  "decode_max_queued": cfg.max_queued("decode")}
    # the decode replicas' engine (a role's own overrides included): its tokenizer, its context
    return router.bind(decode, engine.model, cfg.served_model_name, engine.max_model_len,
                       router_cfg, {"quantization": engine.quantization,
                                    "kv_cache_dtype": engine.kv_cache_dtype,
                                    "generation_config": engine.generation_config,
                                    "override_generation_config":
                                        engine.override_generation_config},
                       prefill)
