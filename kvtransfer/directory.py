"""Which receiving KV endpoints exist, so senders can open links before a request needs one.

Each decode replica publishes its :class:`EndpointInfo` under its app's scope and refreshes it
(:class:`Publisher`); each prefill replica's :class:`LinkWarmer` reads the list every few seconds
and warms the link to every receiver it has not reached yet (``KVEndpoint.warm``: the
transport's set-up plus a one-block write). So links are open when a replica starts, and with
new replicas as they appear; no user request pays a link's first-push cost (CUDA IPC maps the
peer's cache, NCCL builds a communicator, NIXL loads a remote agent and wires UCX up).

The store is Ray's internal key-value store in a cluster (:class:`RayKVStore`, kept by the GCS;
each call bounded by ``STORE_TIMEOUT_S``) and a dict in tests. An entry not refreshed within
``ttl_s`` is stale (its replica died without withdrawing it) and is skipped.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.types import (EndpointInfo, LayoutMismatchError, TransferState,
                              TransportUnavailableError)

log = logging.getLogger(__name__)
TTL_S = 30.0
SCAN_INTERVAL_S = 1.0
RETRY_S = 10.0  # a warming that failed is tried again this much later, while the peer is listed
STALE_AFTER_TTLS = 10  # an entry this many TTLs old is deleted by the reader that finds it
STORE_TIMEOUT_S = 5.0  # a call to the cluster's key-value store (the GCS)


class Store(Protocol):
    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def keys(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...


class DictStore:
    """In one process (tests)."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key, value):
        with self._lock:
            self._data[key] = value

    def get(self, key):
        with self._lock:
            return self._data.get(key)

    def keys(self, prefix):
        with self._lock:
            return [k for k in self._data if k.startswith(prefix)]

    def delete(self, key):
        with self._lock:
            self._data.pop(key, None)


class RayKVStore:
    """Ray's internal key-value store (in the GCS), reachable from every worker of a cluster.
    Every call is bounded by ``timeout_s`` (a GCS that does not answer fails the directory's
    turn, tried again at the next, instead of hanging it, or a replica's shutdown)."""

    NAMESPACE = b"baton"

    def __init__(self, timeout_s: float = STORE_TIMEOUT_S):
        self.timeout_s = timeout_s

    @staticmethod
    def _gcs():
        from ray.experimental.internal_kv import internal_kv_get_gcs_client
        gcs = internal_kv_get_gcs_client()
        if gcs is None:
            raise RuntimeError("Ray is not initialized in this process")
        return gcs

    def put(self, key, value):
        self._gcs().internal_kv_put(key.encode(), value, True, self.NAMESPACE,
                                    timeout=self.timeout_s)

    def get(self, key):
        return self._gcs().internal_kv_get(key.encode(), self.NAMESPACE, timeout=self.timeout_s)

    def keys(self, prefix):
        return [k.decode() for k in self._gcs().internal_kv_keys(
            prefix.encode(), self.NAMESPACE, timeout=self.timeout_s)]

    def delete(self, key):
        self._gcs().internal_kv_del(key.encode(), False, self.NAMESPACE, timeout=self.timeout_s)


class PeerDirectory:
    """The receiving endpoints of one scope (a Serve app)."""

    def __init__(self, scope: str, store: Store | None = None, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.time):
        self.prefix = f"kv-receivers/{scope}/"
        self.store = store if store is not None else RayKVStore()
        self.ttl_s = ttl_s
        self.clock = clock

    def publish(self, info: EndpointInfo) -> None:
        self.store.put(self.prefix + info.endpoint_id, pickle.dumps((self.clock(), info)))

    def withdraw(self, endpoint_id: str) -> None:
        self.store.delete(self.prefix + endpoint_id)

    def peers(self) -> list[EndpointInfo]:
        """Every receiver refreshed within ``ttl_s``. An entry not refreshed for
        ``STALE_AFTER_TTLS`` times that long (its replica crashed, or exited without withdrawing
        it) is deleted, so the store does not keep every receiver that ever ran."""
        now, found = self.clock(), []
        for key in self.store.keys(self.prefix):
            raw = self.store.get(key)
            if raw is None:
                continue
            stamp, info = pickle.loads(raw)
            if now - stamp <= self.ttl_s:
                found.append(info)
            elif now - stamp > STALE_AFTER_TTLS * self.ttl_s:
                self.store.delete(key)
        return found


class _Periodic:
    """A daemon thread that runs ``step`` at once and then every ``interval_s`` until
    :meth:`stop`; a failing step (the store briefly unreachable) is logged and tried again at
    the next turn."""

    def __init__(self, name: str, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def step(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - tried again at the next turn
                log.warning("%s: a turn failed", self._thread.name, exc_info=True)
            if self._stop.wait(self.interval_s):
                return


class Publisher(_Periodic):
    """Keeps one receiver's entry fresh until :meth:`stop` withdraws it."""

    def __init__(self, directory: PeerDirectory, info: EndpointInfo):
        super().__init__("kv-publisher", directory.ttl_s / 3)
        self.directory, self.info = directory, info

    def step(self) -> None:
        self.directory.publish(self.info)

    def stop(self) -> None:
        super().stop()
        try:
            self.directory.withdraw(self.info.endpoint_id)
        except Exception:  # noqa: BLE001 - shutting down: the entry goes stale by itself
            log.debug("withdrawing %s failed", self.info.endpoint_id, exc_info=True)


@dataclass
class LinkState:
    backend: str = ""
    state: str = "warming"  # warming | warm | failed | unavailable | mismatch
    seconds: float = 0.0
    error: str | None = None
    since: float = 0.0


class LinkWarmer(_Periodic):
    """Warms the links from one sending endpoint to every receiver its directory lists.

    ``submit(fn)`` runs ``fn(engine)`` on the thread that owns the endpoint (the engine thread,
    which also polls the endpoint) and returns a Future; the warming itself is a transfer that
    thread drives to its end, so a slow handshake never blocks anyone but the warming.
    """

    def __init__(self, endpoint, directory: PeerDirectory, submit: Callable[..., Future],
                 interval_s: float = SCAN_INTERVAL_S,
                 on_mismatch: Callable[[EndpointInfo], None] | None = None):
        """``on_mismatch(peer)``: a listed receiver's KV layout is not this endpoint's (it is
        never warmed; the owner counts it)."""
        super().__init__("kv-link-warmer", interval_s)
        self.endpoint, self.directory, self.submit = endpoint, directory, submit
        self.on_mismatch = on_mismatch
        self.links: dict[str, LinkState] = {}
        self._lock = threading.Lock()

    def step(self) -> None:
        self.scan()

    def summary(self) -> dict[str, dict]:
        with self._lock:
            return {pid: {"backend": s.backend, "state": s.state, "seconds": s.seconds}
                    for pid, s in self.links.items()}

    def scan(self) -> list[str]:
        """Start warming every listed receiver not yet warm (or whose warming failed a while
        ago); returns the endpoint ids started."""
        started, now = [], time.time()
        for peer in self.directory.peers():
            pid = peer.endpoint_id
            with self._lock:
                link = self.links.get(pid)
                if link is not None and (link.state in ("warm", "warming", "unavailable",
                                                        "mismatch")
                                         or now - link.since < RETRY_S):
                    continue
                try:
                    backend = self.endpoint.choose(peer)
                    self.endpoint.plan(peer)  # the KV layouts, before anything moves
                except TransportUnavailableError as exc:  # cuda_ipc across nodes, say
                    self.links[pid] = LinkState(state="unavailable", error=str(exc), since=now)
                    continue
                except LayoutMismatchError as exc:  # a configuration error: said once, loudly
                    self.links[pid] = LinkState(state="mismatch", error=str(exc), since=now)
                    log.error("KV link to %s (node %s) refused: its KV layout is not this "
                              "replica's (both roles must serve the same model, dtype, KV cache "
                              "dtype and block size): %s", pid, peer.node_id, exc)
                    if self.on_mismatch is not None:
                        self.on_mismatch(peer)
                    continue
                self.links[pid] = LinkState(backend=backend, since=now)
            self.submit(self._warm_on_engine_thread(peer))
            started.append(pid)
        return started

    def _warm_on_engine_thread(self, peer: EndpointInfo):
        start = time.perf_counter()

        def done(t):  # engine thread, once
            with self._lock:
                link = self.links[peer.endpoint_id]
                link.seconds = time.perf_counter() - start
                link.state = "warm" if t.state is TransferState.DONE else "failed"
                link.error = t.error
            if t.state is TransferState.DONE:
                log.info("KV link to %s (node %s) over %s warmed in %.1f ms", peer.endpoint_id,
                         peer.node_id, t.backend, 1e3 * link.seconds)
            else:
                log.warning("warming the KV link to %s failed: %s", peer.endpoint_id, t.error)

        def warm(_engine):
            try:
                self.endpoint.warm(peer, done)
            except Exception as exc:  # noqa: BLE001 - a layout mismatch, a transport error
                with self._lock:
                    self.links[peer.endpoint_id].state = "failed"
                    self.links[peer.endpoint_id].error = f"{type(exc).__name__}: {exc}"
                log.warning("warming the KV link to %s failed: %s", peer.endpoint_id, exc)

        return warm
