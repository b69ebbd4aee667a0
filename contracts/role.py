"""What the prefill and decode deployments share: the Serve methods every role replica answers
(its load, its engine's counters, a prefix-cache reset, its health) and the load report they
are built from. Each role's server (``self.server``) runs its engine on an
:class:`engine.async_engine.AsyncEngine`; these read only the snapshot that engine's thread
publishes (``aengine.feed``), never the engine itself."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import asdict

log = logging.getLogger("baton.role")

# How often a role replica looks at its engine (``RoleDeployment.watch_engine``).
ENGINE_WATCH_S = 0.5
# A listing of a role's replica actors (the cluster's registry) that has not answered by then
# is taken as unknown, as one that failed.
REGISTRY_TIMEOUT_S = 5.0


def load_report(aengine, endpoint) -> dict:
    """A role replica's KV load, for the request routers and benchmarks."""
    snap = aengine.feed.latest
    return {"used_blocks": snap.kv_blocks_used, "free_blocks": snap.kv_blocks_free,
            "held_blocks": endpoint.held_blocks if endpoint is not None else 0,
            "host_blocks": snap.host_blocks_used + snap.host_blocks_free,
            "host_hit_blocks": snap.host_hit_blocks, "host_bytes_to_host": snap.host_bytes_to_host,
            "host_bytes_to_device": snap.host_bytes_to_device,
            **{f"host_{kind}_{way}": getattr(snap, f"host_{kind}_{way}")
               for kind in ("seconds", "timed_bytes") for way in ("to_host", "to_device")},
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

    def record_routing_stats(self) -> dict:
        """Read by both pools' request router (``router.replica_choice.KVAwareRouter``): the
        fraction of KV blocks in use and how many blocks the GPU cache and the host tier hold."""
        snap = self.server.aengine.feed.latest
        return {"kv_used_fraction": snap.kv_cache_usage,
                "kv_blocks": snap.kv_blocks_used + snap.kv_blocks_free,
                "kv_host_blocks": snap.host_blocks_used + snap.host_blocks_free}

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (benchmarks replaying prompts)."""
        return await self.server.aengine.call(lambda engine: engine.reset_prefix_cache())

    async def engine_stats(self) -> dict:
        """The engine's step counters (:class:`engine.llm_engine.EngineStats`) after its
        latest step."""
        return asdict(self.server.aengine.feed.latest.stats)

    async def early_starts(self) -> dict:
        """Requests started ahead of their Serve calls (``router.early_start``): how many their
        calls claimed, how many were dropped."""
        return dict(getattr(self.server, "whole", self.server).early_starts)

    async def record_autoscaling_stats(self) -> dict:
        """Serve's autoscaler asks every replica for these (read by the policies in
        ``deploy.autoscaling``); from the engine's published snapshot only."""
        report, self._autoscaling_previous = autoscaling_stats(
            self.server.aengine.feed.latest, self._autoscaling_previous)
        return report

    def check_health(self) -> None:
        self.server.aengine.check()  # the engine thread, and every rank of a split model

    def watch_engine(self, period_s: float = ENGINE_WATCH_S,
                     exit_process=os._exit) -> threading.Thread:
        """Exit the replica's process as soon as its engine has failed (its thread died, or a
        rank of a split model did), killing the other ranks first. Serve then replaces the
        replica as it does one that crashed, and the ingress moves its requests as it does a
        killed replica's; a failed health check alone takes three in a row (20-30 s at their
        10 s period) before Serve replaces a replica. vLLM's server likewise exits when its
        engine dies. An engine being shut down is left alone."""
        aengine = self.server.aengine

        def watch():
            while not aengine.stopped:
                time.sleep(period_s)
                try:
                    aengine.check()
                except Exception as exc:  # noqa: BLE001 - any failure is fatal to the replica
                    if aengine.stopped:
                        return
                    log.error("the engine failed (%s): this replica exits so that Serve "
                              "replaces it now", exc)
                    for stream in (sys.stdout, sys.stderr):
                        stream.flush()
                    try:
                        aengine.kill_ranks()
                    finally:
                        exit_process(1)
                    return

        thread = threading.Thread(target=watch, name="baton-engine-watch", daemon=True)
        thread.start()
        return thread

    def __del__(self):
        if self.server is not None:
            self.server.close()


async def any_replica_answers(handle, timeout_s: float) -> bool:
    """Whether a replica of the deployment behind ``handle`` is alive: one of its replica
    actors answers a direct call within ``timeout_s``. Direct, not through Serve: a replica
    whose queue is full (overload) is busy, not gone. A handle that is not Serve's (tests) is
    asked for the deployment's ``kv_load``. A registry that cannot be listed counts as alive
    (not known to be gone)."""
    prefix = replica_actor_prefix(handle)
    if prefix is None:
        async def ask():
            await handle.kv_load.remote()

        tasks = [asyncio.ensure_future(ask())]
    else:
        try:
            actors = await listed_replica_actors(prefix)
        except Exception:  # noqa: BLE001 - the cluster's registry did not answer
            return True
        tasks = [asyncio.ensure_future(_ping(a)) for a in actors]
    if not tasks:
        return False
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    return any(t.exception() is None for t in done)


class SharedAnswer:
    """One question about the cluster asked at a time for every caller, its answer kept for
    ``keep_s`` once it has come (many silent calls, one probe)."""

    def __init__(self, ask, keep_s: float):
        self.ask, self.keep_s = ask, keep_s
        self._answer: asyncio.Future | None = None
        self._at = 0.0

    async def get(self):
        now = time.monotonic()
        if self._answer is None or (self._answer.done() and now - self._at > self.keep_s):
            self._at = now
            self._answer = asyncio.ensure_future(self.ask())
        return await asyncio.shield(self._answer)


async def role_gone(handle, timeout_s: float) -> bool:
    """Whether the deployment behind ``handle`` has, for certain, no live replica: the cluster
    lists none of its replica actors, or every one listed fails a direct call (dead). A replica
    that does not answer within ``timeout_s`` (busy, starting) is not gone, nor is a handle that
    is not Serve's or a registry that cannot be listed: only what is known counts."""
    prefix = replica_actor_prefix(handle)
    if prefix is None:
        return False
    try:
        actors = await listed_replica_actors(prefix)
    except Exception:  # noqa: BLE001 - the cluster's registry did not answer
        return False
    if not actors:
        return True
    tasks = [asyncio.ensure_future(_ping(a)) for a in actors]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    return not pending and all(t.exception() is not None for t in done)


async def role_full(handle, max_ongoing: int | None, timeout_s: float) -> bool:
    """Whether every live replica of the deployment behind ``handle`` holds ``max_ongoing``
    requests, so a request waiting in Serve's queue waits for one of them to end. A replica
    that does not answer within ``timeout_s`` is busy (full); one still starting reports room;
    with none listed, or the registry not answering, the deployment is not known to be full.
    A handle that is not Serve's, or no bound: full when a replica answers."""
    prefix = replica_actor_prefix(handle)
    if prefix is None or max_ongoing is None:
        return await any_replica_answers(handle, timeout_s)
    try:
        actors = await listed_replica_actors(prefix)
    except Exception:  # noqa: BLE001 - the cluster's registry did not answer
        return False
    tasks = [asyncio.ensure_future(actor.get_num_ongoing_requests.remote()) for actor in actors]
    if not tasks:
        return False
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    counts = [t.result() for t in done if t.exception() is None]
    return bool(counts or pending) and all(n >= max_ongoing for n in counts)


def replica_actor_prefix(handle) -> str | None:
    """The name prefix of a Serve deployment's replica actors (``SERVE_REPLICA::app#name#``);
    None for a handle that is not Serve's."""
    app, name = getattr(handle, "app_name", None), getattr(handle, "deployment_name", None)
    if not isinstance(name, str):
        return None
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX

    return f"{REPLICA_ID_FULL_ID_STR_PREFIX}{f'{app}#' if app else ''}{name}#"


class ReplicaCount:
    """How many replica actors of a Serve deployment the cluster lists, for callers that cannot
    wait (an HTTP door): ``value`` is the last count (None before the first, or for a handle
    that is not Serve's); reading it starts a recount in the background once it is
    ``refresh_s`` old. Must be read on the event loop."""

    def __init__(self, handle, refresh_s: float = 2.0):
        self.prefix = replica_actor_prefix(handle)
        self.refresh_s = refresh_s
        self._value: int | None = None
        self._at = -refresh_s
        self._counting = False

    @property
    def value(self) -> int | None:
        now = time.monotonic()
        if self.prefix is not None and not self._counting and now - self._at >= self.refresh_s:
            self._counting, self._at = True, now
            asyncio.ensure_future(self._count())
        return self._value

    async def _count(self) -> None:
        try:
            self._value = len(await asyncio.to_thread(replica_names, self.prefix))
        except Exception:  # noqa: BLE001 - the registry did not answer: keep the last count
            pass
        finally:
            self._counting = False


def replica_names(prefix: str) -> list[dict]:
    """The named actors (``name``, ``namespace``) whose name starts with ``prefix`` (blocking:
    the cluster's registry)."""
    import ray

    return [e for e in ray.util.list_named_actors(all_namespaces=True)
            if e["name"].startswith(prefix)]


def replica_actors(prefix: str) -> list:
    """The live actors whose name starts with ``prefix`` (blocking: the cluster's registry)."""
    import ray

    actors = []
    for entry in replica_names(prefix):
        try:
            actors.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        except ValueError:  # gone since it was listed
            continue
    return actors


async def listed_replica_actors(prefix: str) -> list:
    """:func:`replica_actors` off the event loop, bounded by ``REGISTRY_TIMEOUT_S`` (a registry
    that does not answer raises ``TimeoutError``, which callers take as "not known")."""
    return await asyncio.wait_for(asyncio.to_thread(replica_actors, prefix), REGISTRY_TIMEOUT_S)


async def _ping(actor) -> None:
    await actor.get_num_ongoing_requests.remote()
