"""The app's bound of open generation requests, told to the HAProxy of this replica's node, which
then refuses what is beyond it itself (429 with Retry-After, in well under a millisecond).

On a local cluster HAProxy runs through ``deploy/haproxy_local.sh``, which adds to each app
backend of the HTTP frontend a rule refusing a generation request while the backend holds as
many open requests as the entry ``<backend> <bound>:<retry-after>:<until>`` of the map file
``baton-bounds.map`` beside the config says, until ``until`` (epoch seconds). Each ingress
replica renews that entry for its own backend (the one listing it as a server) every second,
``until`` a few seconds ahead, so an entry nobody renews (an app shut down, whose successor of
the same name must not inherit its bound) lapses: the bound is what the door admits (the decode
pool's live replicas x their ongoing and queued bounds, :meth:`RequestService.pool_bound`), the
Retry-After the router's. It writes the file (kept across HAProxy's reloads) and the running
HAProxy's copy (the runtime API's ``set map``/``add map``/``del map`` over the admin socket);
every replica of the app writes the same values. Where the config has no such rules (a cluster
whose HAProxy runs as Ray starts it), nothing is done and the door refuses instead. Every step
is bounded by a timeout and a failure is retried on the next tick: the door stays the bound.
"""

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
MAP_NAME = "baton-bounds.map"
EVERY_S = 1.0
LEASE_S = 3  # how long past its last renewal an entry holds
CLI_TIMEOUT_S = 2.0


def node_paths() -> tuple[Path, Path] | None:
    """The admin socket and the config of this node's HAProxy (Ray scopes both by node id:
    ``RAY_SERVE_HAPROXY_SOCKET_PATH`` and ``..._CONFIG_FILE_LOC`` with the node's id as the last
    directory); None outside a Ray worker."""
    try:
        import ray
        from ray.serve._private.constants import (RAY_SERVE_HAPROXY_CONFIG_FILE_LOC,
                                                  RAY_SERVE_HAPROXY_SOCKET_PATH)

        node = ray.get_runtime_context().get_node_id()
        return tuple(Path(p).parent / node / Path(p).name
                     for p in (RAY_SERVE_HAPROXY_SOCKET_PATH, RAY_SERVE_HAPROXY_CONFIG_FILE_LOC))
    except Exception:  # noqa: BLE001 - no Ray here (a unit test): no HAProxy either
        return None


def own_backends(config: str, replica: str) -> list[str]:
    """The backends of ``config`` that have Baton's refusal rule and list ``replica`` (Serve's
    unique id of this replica: its server is ``SERVE_REPLICA_<app>-<deployment>-<id>``)."""
    ruled = set(re.findall(r"set-var\(txn\.baton_bound\) str\(([^)\s]+)\)", config))
    found, backend = [], None
    for line in config.splitlines():
        words = line.split()
        if line.startswith("backend ") and len(words) > 1:
            backend = words[1]
        elif not line[:1].isspace():
            backend = None
        elif (backend in ruled and backend not in found and len(words) > 1
              and words[0] == "server" and words[1].startswith("SERVE_REPLICA_")
              and words[1].endswith(f"-{replica}")):
            found.append(backend)
    return found


def read_map(text: str) -> dict[str, str]:
    """``key value`` lines (a map file, or ``show map``'s output less its entry ids)."""
    entries = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 3 and words[0].startswith("0x"):  # show map: "<id> <key> <value>"
            words = words[1:]
        if len(words) == 2 and not words[0].startswith("#"):
            entries[words[0]] = words[1]
    return entries


async def cli(socket_path: Path, command: str) -> str:
    """One command of HAProxy's runtime API; its answer."""
    async def talk():
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        try:
            writer.write(command.encode() + b"\n")
            await writer.drain()
            return (await reader.read()).decode(errors="replace")
        finally:
            writer.close()
    return await asyncio.wait_for(talk(), CLI_TIMEOUT_S)


class HAProxyBound:
    """Keeps this replica's backend entry in its node's ``baton-bounds.map`` (see the module).
    ``bound``: the app's bound of open generation requests, or None (none known: no entry,
    HAProxy refuses nothing); ``retry_after_s``: the refusals' Retry-After; ``paths``: the
    node's HAProxy admin socket and config (:func:`node_paths`; None: nothing to do)."""

    def __init__(self, bound: Callable[[], int | None], retry_after_s: float, replica: str,
                 paths: tuple[Path, Path] | None):
        self.bound = bound
        self.retry_after = max(1, round(retry_after_s))
        self.replica = replica
        self.paths = paths
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Run on the current event loop (where the door reads the bound), if there is one."""
        if self.paths is None or self._task is not None:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._run())
        except RuntimeError:  # no loop: a constructor called outside Serve
            pass

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - HAProxy reloading, a socket gone: next tick
                log.debug("HAProxy bound not updated: %r", exc)
            await asyncio.sleep(EVERY_S)

    async def tick(self) -> None:
        """One pass: the file's and the running HAProxy's entries made to say the bound."""
        socket, config = self.paths
        bounds = config.with_name(MAP_NAME)
        if not bounds.exists() or not config.exists():
            return
        backends = own_backends(config.read_text(), self.replica)
        if not backends:
            return
        bound = self.bound()
        until = int(time.time()) + LEASE_S
        value = f"{bound}:{self.retry_after}:{until}" if bound else None
        self._write_file(bounds, backends, value)
        running = read_map(await cli(socket, f"show map {bounds}"))
        for backend in backends:
            if running.get(backend) == value:
                continue
            if value is None:
                await cli(socket, f"del map {bounds} {backend}")
            elif backend in running:
                await cli(socket, f"set map {bounds} {backend} {value}")
            else:
                await cli(socket, f"add map {bounds} {backend} {value}")

    @staticmethod
    def _write_file(path: Path, backends: list[str], value: str | None) -> None:
        entries = read_map(path.read_text())
        wanted = dict(entries)
        for backend in backends:
            if value is None:
                wanted.pop(backend, None)
            else:
                wanted[backend] = value
        if wanted != entries:
            tmp = path.with_name(f"{path.name}.{os.getpid()}")
            tmp.write_text("".join(f"{k} {v}\n" for k, v in wanted.items()))
            os.replace(tmp, path)
