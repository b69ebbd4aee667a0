"""What the benchmarks share: device timing and the two ceilings, a Ray of the benchmark's own
with Baton's settings and an app on it (context managers), and the replicas' processes."""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass



# ``--decode-tensor-cores auto|on|off`` as the engine's ``decode_tensor_cores`` (auto: None)
TENSOR_CORES = {"auto": None, "on": True, "off": False}


def dispatch(tool: str, tools: dict, argv: list[str] | None = None) -> None:
    """``python -m benchmarks.<tool> NAME [options]``: run ``tools[NAME](options)``."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in tools:
        raise SystemExit(f"usage: python -m benchmarks.{tool} {{{'|'.join(tools)}}} [options] "
                         "(each takes --help)")
    tools[argv[0]](argv[1:])


# -- device timing ----------------------------------------------------------------------------
def cuda_ms(fn, reps: int = 10) -> float:
    """Median device milliseconds of ``fn()`` (after one call that compiles and settles)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(run, items, reps: int = 10) -> float:
    """µs per ``run(item)``: one CUDA graph calling it for every item in order, replayed
    ``reps`` times (items such as one weight or cache per layer keep L2 from serving them)."""
    import torch

    for item in items[:2]:
        run(item)  # compile, settle
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in items:
            run(item)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(items))


def ceilings() -> dict:
    """The GPU's two ceilings, measured now: device copy GB/s (bytes read + written) and bf16
    GEMM TFLOP/s."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_gbs = 2 * a.numel() / cuda_ms(lambda: b.copy_(a)) / 1e6
    del a, b
    n = 8192
    x, y = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    tflops = 2 * n**3 / cuda_ms(lambda: x @ y) / 1e9
    return {"copy_GBps": round(copy_gbs, 1), "gemm_TFLOPs": round(tflops, 1)}


def sustained_gemm_tflops(seconds: float = 2.0, n: int = 8192) -> float:
    """bf16 GEMM TFLOP/s once the GPU has run GEMMs back to back for ``seconds``: the rate
    under its power limit. :func:`ceilings` times ten GEMMs (~15 ms), before the clocks come
    down; a long prefill, or prompts back to back, run at the capped clocks (an H200's SM clock
    fell from 1,980 MHz to 1,215-1,575 under 2,048-token prefills back to back, nvidia-smi's
    reason: the software power cap)."""
    import torch

    x, y = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            x @ y
        torch.cuda.synchronize()
    return 2 * n**3 / cuda_ms(lambda: x @ y, reps=20) / 1e9


def copy_ceiling(devices, nbytes: int, reps: int = 20) -> float:
    """Bytes per second of a plain copy of ``nbytes`` (device copy, or peer copy between the
    two devices)."""
    import torch

    if devices[0] == "cpu":
        a = torch.randn(nbytes // 4)
        b = torch.empty_like(a)
        t0 = time.perf_counter()
        for _ in range(reps):
            b.copy_(a)
        return nbytes * reps / (time.perf_counter() - t0)
    a = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=devices[0])
    b = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=devices[1])
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(devices[0])
    torch.cuda.synchronize(devices[1])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(devices[0])
        torch.cuda.synchronize(devices[1])
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


# -- a Ray and an app of the benchmark's own ----------------------------------------------------
@contextmanager
def local_ray(num_cpus: int | None = None, env_vars: dict | None = None, plain: bool = False,
              **init_kwargs):
    """A Ray of this driver's own with Baton's settings (``plain``: none of them, as a user's
    own ``ray start`` would be; ``deploy.ray_env.init_ray``); shut down on exit. Yields the
    settings in effect."""
    import ray

    from deploy import ray_env

    settings = ray_env.init_ray(num_cpus=num_cpus or max(4, os.cpu_count() or 2),
                                env_vars=env_vars, plain=plain, **init_kwargs)
    try:
        yield settings
    finally:
        ray.shutdown()


@dataclass
class App:
    url: str  # http://127.0.0.1:<port>
    grpc: str  # 127.0.0.1:<port>
    ready_s: float


@contextmanager
def served(config: dict, timeout: float = 300.0):
    """The app of ``config`` (``deploy.app.build_app``'s args) on the local Ray, HTTP and gRPC
    on free ports, once it answers; Serve shut down on exit."""
    from ray import serve

    from deploy.app import build_app
    from deploy.cli import GRPC_SERVICER, wait_ready
    from deploy.ray_env import free_port

    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    t0 = time.time()
    try:
        serve.run(build_app(config), name="baton", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout)
        yield App(url, f"127.0.0.1:{grpc_port}", time.time() - t0)
    finally:
        serve.shutdown()


# -- the replicas' processes --------------------------------------------------------------------
def replica_pids(deployment: str) -> list[int]:
    """PIDs of the deployment's replicas (by process title); when this driver started the local
    Ray cluster, only that cluster's (children of its raylet: another cluster on the machine
    has replicas of the same title)."""
    from ray.thirdparty_files import psutil

    raylet = _own_raylet_pid()
    return [p.pid for p in psutil.process_iter(["cmdline", "ppid"])
            if f"ServeReplica:baton:{deployment}" in " ".join(p.info["cmdline"] or [])
            and (raylet is None or p.info["ppid"] == raylet)]


def _own_raylet_pid() -> int | None:
    import ray
    from ray._private import ray_constants

    node = ray._private.worker._global_node if ray.is_initialized() else None
    procs = getattr(node, "all_processes", None) or {}
    raylets = procs.get(ray_constants.PROCESS_TYPE_RAYLET) or []
    return raylets[0].process.pid if raylets else None


def migrations(url: str) -> float:
    """Streams the app's ingress has moved to another decode replica so far."""
    import requests

    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("baton_request_migrations_total "):
            return float(line.split()[1])
    return 0.0
