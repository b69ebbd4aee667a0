"""The prefill:decode ratio sweep: for each layout deploy the app, run locust headless at each
load, tear down; then write the report.

    python -m loadtests.sweep --model tiny --layouts colo1,1p1d --rates 1,2 --duration 10 \
        --input-len 64 --output-len 16 --slo-ttft-ms 2000 --slo-itl-ms 500 --out results/cpu
    python -m loadtests.sweep --model dummy:Qwen3-8B --layouts colo2,1p1d --gpus-per-replica 1 \
        --rates 1,2,4,8 --duration 60 --input-len 2048 --output-len 256 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --out results/h200x2

Writes ``OUT/<layout>/<load>/`` (locust's CSVs, ``requests.jsonl``, ``locust.log``),
``OUT/workloads/``, ``OUT/config.json`` and the report (``summary.md``, ``summary.csv``,
``summary.json``, PNG plots). Ray: an initialised Ray is used as it is; by default the sweep
starts a local Ray of its own (never the one ``ray start`` runs on this machine) and stops it at
the end; ``--address`` joins a cluster (``auto``: the one running here). Each layout is deployed
as the app ``baton-sweep`` and taken down after it: on a Ray the sweep started, by shutting Serve
down; on one it joined, by deleting only its own app (Serve and every other app keep running,
and the sweep uses Serve's ports as they are). A layout that fails (cannot be placed, does not
come up, breaks mid-run) is reported and the sweep goes on; the exit status is 1 if anything
failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from deploy.ray_env import free_port
from loadtests import workloads
from loadtests.config import CPU_ENGINE, SweepConfig
from loadtests.layouts import Layout, Resources, missing_resources, parse_layouts
from loadtests.metrics import Slo, read_records, summarize
from loadtests.report import write_report

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
GRPC_SERVICER = "proto.servicer.add_to_server"
APP_NAME = "baton-sweep"


@dataclass
class SweepResult:
    out: Path
    points: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)


class LayoutError(RuntimeError):
    """A layout could not be deployed or answered badly; the sweep reports it and goes on."""


# -- Ray and Serve ----------------------------------------------------------------------------
def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def ensure_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray unless this process already is: a local Ray of its own (``address`` None)
    or the cluster at ``address``. True when this call started a Ray (which the sweep owns)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from deploy import ray_env
    ray_env.init_ray(address, num_cpus)  # a local one gets Baton's serving settings
    return address is None


def wait_for_resources(layout: Layout, res: Resources, cluster: dict,
                       timeout_s: float = 60.0, routers: int = 1) -> None:
    """Fail at once if the cluster can never hold ``layout``; else wait (the last layout's
    replicas may still be going away) until its resources are free."""
    import ray

    if reason := missing_resources(layout, res, cluster, routers):
        raise LayoutError(reason)
    deadline = time.monotonic() + timeout_s
    while reason := missing_resources(layout, res, ray.available_resources(), routers):
        if time.monotonic() > deadline:
            raise LayoutError(f"{reason} free")
        time.sleep(1)


@dataclass(frozen=True)
class Endpoints:
    http: str
    grpc: str | None


@contextmanager
def deployed(app_config: dict, timeout_s: float, owned: bool = True):
    """Serve ``app_config`` until the block ends. On a Ray this sweep started (``owned``): Serve
    on fresh ports, shut down after. On a joined cluster: Serve as it runs there (started with
    fresh ports if it was not running), and only this app deleted after."""
    from ray import serve

    from deploy.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                grpc_options={"port": free_port(), "grpc_servicer_functions": [GRPC_SERVICER],
                              "enable_reflection": False})
    http_port, grpc_port = serve_ports()
    try:
        # _run without blocking: serve.run would wait forever on replicas that never fit.
        serve._run(build_app(app_config), _blocking=False, name=APP_NAME, route_prefix="/")
        _wait_running(time.monotonic() + timeout_s)
        yield Endpoints(f"http://127.0.0.1:{http_port}",
                        f"127.0.0.1:{grpc_port}" if grpc_port else None)
    finally:
        if owned:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)


def serve_ports() -> tuple[int, int]:
    """The HTTP and gRPC ports Serve listens on (a running Serve keeps its own options; gRPC
    None where it was started without a servicer, hence without gRPC)."""
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    http, grpc = ray.get([controller.get_http_config.remote(),
                          controller.get_grpc_config.remote()], timeout=30)
    return http.port, (grpc.port if grpc.grpc_servicer_functions else None)


def _wait_running(deadline: float) -> None:
    from ray import serve

    status = None
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        status = app.status if app else None
        if status == "RUNNING":
            return
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise LayoutError(f"the app is {status}: {app.message[:500]}")
        time.sleep(1)
    raise LayoutError(f"the app did not reach RUNNING in time (last status {status})")


def warm_up(ends: Endpoints, cfg: SweepConfig, maker) -> None:
    """Two short requests (one at the workload's prompt length) so first-use costs stay out of
    the figures; a layout that cannot answer them fails here."""
    import random

    import requests

    deadline = time.monotonic() + 60
    while True:  # the proxy may learn the route a moment after the app is RUNNING
        try:
            if requests.get(f"{ends.http}/health", timeout=5).ok:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise LayoutError(f"{ends.http}/health did not answer within 60s")
        time.sleep(0.5)
    prompt = maker.piece(random.Random(-1), cfg.workload.input_len)
    for body in ({"prompt": prompt, "max_tokens": 2}, {"prompt": prompt[:8], "max_tokens": 4}):
        resp = requests.post(f"{ends.http}/v1/completions", timeout=cfg.request_timeout_s,
                             json={**body, "temperature": 0, "ignore_eos": True})
        if resp.status_code != 200:
            raise LayoutError(f"warm-up request: HTTP {resp.status_code}: {resp.text[:300]}")
    if cfg.protocol == "grpc":
        import grpc

        if ends.grpc is None:
            raise LayoutError("Serve on this cluster was started without gRPC (no servicer "
                              "functions): run the sweep with --protocol http, or start Serve "
                              f"with {GRPC_SERVICER}")

        from proto import baton_pb2, baton_pb2_grpc
        with grpc.insecure_channel(ends.grpc) as channel:
            baton_pb2_grpc.BatonStub(channel).Health(baton_pb2.HealthRequest(), timeout=30,
                                                     metadata=(("application", APP_NAME),))


# -- one load point -------------------------------------------------------------------------
def locust_command(cfg: SweepConfig, load: float, host: str, workload_file: Path,
                   run_dir: Path, process: int = 0) -> list[str]:
    """The locust command of process ``process`` (of ``cfg.processes``) at ``load``: process 0
    writes ``locust_*.csv`` and ``requests.jsonl``, process k ``locust.pK_*`` and
    ``requests.pK.jsonl``."""
    users = 1 if cfg.open_loop else int(load)
    run_time = cfg.duration_s + cfg.drain_s + 30 if cfg.open_loop else cfg.duration_s
    user_class = "OpenAIStreamUser" if cfg.protocol == "http" else "GrpcStreamUser"
    suffix = f".p{process}" if process else ""
    rate = load / cfg.processes if cfg.open_loop else 0
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class, "--headless",
            "--host", host, "-u", str(users), "-r", str(users),
            "--run-time", f"{math.ceil(run_time)}s", "--stop-timeout", f"{cfg.drain_s:g}",
            "--csv", str(run_dir / f"locust{suffix}"), "--only-summary", "--loglevel", "WARNING",
            "--exit-code-on-error", "0", "--workload-file", str(workload_file),
            "--records-file", str(run_dir / f"requests{suffix}.jsonl"),
            # the rate exactly: locust draws its schedule from it, and the sweep sized this
            # process's slice of the workload (and the planner replays it) from the same draw
            "--rate", f"{rate:.17g}", "--duration", f"{cfg.duration_s:g}",
            "--drain-timeout", f"{cfg.drain_s:g}", "--arrival", cfg.arrival,
            "--seed", str(cfg.sender_seed(load, process)),
            "--request-timeout", f"{cfg.request_timeout_s:g}",
            "--temperature", f"{cfg.temperature:g}", "--application", APP_NAME]


def run_locust(cmds: list[list[str]], run_dir: Path, limit_s: float, progress=None) -> None:
    """Run the locust processes of one point (each in its own process: gevent patches
    everything it imports) and show how many requests have finished; a LayoutError if one
    fails or they overrun ``limit_s``. Process k logs to ``locust.log`` (k 0) or
    ``locust.pK.log``."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    logs = [run_dir / ("locust.log" if k == 0 else f"locust.p{k}.log") for k in range(len(cmds))]
    procs = []
    try:
        for cmd, path in zip(cmds, logs):
            with open(path, "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              env=env, cwd=ROOT))
        deadline = time.monotonic() + limit_s
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline:
                raise LayoutError(f"locust ran past {limit_s:.0f}s; see {logs[0]}")
            if progress is not None:
                progress(sum(p.read_bytes().count(b"\n") for p in run_dir.glob("requests*.jsonl")))
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    for proc, path in zip(procs, logs):
        if proc.returncode != 0:
            raise LayoutError(f"locust exited with {proc.returncode}: {path.read_text()[-500:]}")


# -- the sweep --------------------------------------------------------------------------------
def prepare_workloads(cfg: SweepConfig, maker) -> dict[float, list[Path]]:
    """One workload per load, shared by every layout; open loop: exactly as many requests as
    the load's arrival schedules send, one file per locust process (its slice, in order)."""
    folder = cfg.out / "workloads"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for load in cfg.loads():
        seed = cfg.seed_for(load)
        if cfg.open_loop:
            counts = [max(1, len(schedule)) for schedule in cfg.schedules(load)]
        else:
            counts = [cfg.workload.num_requests]
        spec = cfg.workload.model_copy(update={"seed": seed, "num_requests": sum(counts)})
        requests = workloads.build(spec, maker)
        name = cfg.label(load)
        whole = folder / f"{name}.jsonl"
        workloads.save(requests, whole)
        if len(counts) == 1:
            files[load] = [whole]
            continue
        files[load], start = [], 0
        for k, count in enumerate(counts):
            files[load].append(folder / f"{name}.p{k}.jsonl")
            workloads.save(requests[start:start + count], files[load][-1])
            start += count
    return files


def run_layout(layout: Layout, cfg: SweepConfig, files: dict, maker, result: SweepResult,
               bar, owned: bool = True) -> None:
    from deploy.config import BatonConfig

    app_config = layout.app_config(cfg.engine_config(), cfg.resources,
                                   transfer={"backend": cfg.transfer_backend},
                                   router={"request_timeout_s": cfg.request_timeout_s,
                                           "num_replicas": cfg.router_replicas})
    if not layout.colocated:
        app_config["disaggregation"] = {"mode": cfg.disaggregation}
    BatonConfig(**app_config)  # refuse a bad config before anything is deployed
    (cfg.out / layout.name).mkdir(parents=True, exist_ok=True)
    (cfg.out / layout.name / "app_config.json").write_text(json.dumps(app_config, indent=1))
    bar.set_postfix_str(f"{layout.name}: deploying")
    with deployed(app_config, cfg.deploy_timeout_s, owned) as ends:
        warm_up(ends, cfg, maker)
        for load in cfg.loads():
            label = cfg.label(load)
            try:
                row = run_point(layout, load, cfg, ends, files[load], bar)
                result.points.append(row)
                bar.write(_point_line(row))
            except LayoutError as exc:
                result.failures.append({"layout": layout.name, "load": label, "error": str(exc)})
                bar.write(f"{layout.name} {label}: FAILED: {exc}")
            bar.update(1)


def merge_records(run_dir: Path, processes: int) -> None:
    """Append the records of locust processes 1.. to ``requests.jsonl`` (process 0's)."""
    if processes < 2:
        return
    with open(run_dir / "requests.jsonl", "a") as out:
        for k in range(1, processes):
            part = run_dir / f"requests.p{k}.jsonl"
            if part.exists():
                out.write(part.read_text())
                part.unlink()


def run_point(layout: Layout, load: float, cfg: SweepConfig, ends: Endpoints,
              workload: list[Path], bar) -> dict:
    label = cfg.label(load)
    run_dir = cfg.out / layout.name / label
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("requests*.jsonl"):
        old.unlink()
    host = ends.http if cfg.protocol == "http" else ends.grpc
    cmds = [locust_command(cfg, load, host, path, run_dir, k) for k, path in enumerate(workload)]
    limit = cfg.duration_s + cfg.drain_s + 120
    run_locust(cmds, run_dir, limit, lambda n: bar.set_postfix_str(f"{layout.name} {label}: "
                                                                   f"{n} requests done"))
    merge_records(run_dir, len(cmds))
    records = read_records(run_dir / "requests.jsonl")
    if not records:
        raise LayoutError(f"no request was recorded; see {run_dir / 'locust.log'}")
    return {"layout": layout.name, "load": load, "label": label, **summarize(records, cfg.slo, cfg.duration_s)}


def _point_line(row: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.0f}"
    return (f"{row['layout']} {row['label']}: {row['requests']} requests, {row['errors']} errors, "
            f"TTFT p50 {f(row['ttft_p50_ms'])} ms, ITL p99 {f(row['itl_p99_ms'])} ms, "
            f"{row['output_tok_s']:.1f} tok/s, SLO met by {row['slo_fraction']:.0%}")


def run_sweep(cfg: SweepConfig) -> SweepResult:
    """Run every layout at every load and write the report; failures are collected, not
    raised."""
    import ray
    from tqdm import tqdm

    owned = ensure_ray(cfg.address, cfg.num_cpus)
    result = SweepResult(cfg.out)
    try:
        cluster = ray.cluster_resources()
        layouts = parse_layouts(cfg.layouts, cluster.get("GPU", 0.0), cfg.resources.num_gpus)
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "config.json").write_text(cfg.model_dump_json(indent=1))
        maker = workloads.prompt_maker(cfg.model, cfg.prompt_format)
        files = prepare_workloads(cfg, maker)
        with tqdm(total=len(layouts) * len(cfg.loads()), desc="sweep", unit="run",
                  file=sys.stderr, dynamic_ncols=True) as bar:
            for layout in layouts:
                before = bar.n
                try:
                    wait_for_resources(layout, cfg.resources, cluster,
                                       routers=cfg.router_replicas)
                    run_layout(layout, cfg, files, maker, result, bar, owned)
                except Exception as exc:  # noqa: BLE001 - report the layout, go on
                    msg = f"{type(exc).__name__}: {exc}"[:1000]
                    result.failures.append({"layout": layout.name, "load": None, "error": msg})
                    bar.write(f"{layout.name}: FAILED: {msg}")
                    bar.update(before + len(cfg.loads()) - bar.n)
        write_report(cfg, result.points, result.failures, _run_meta(cluster))
    finally:
        if owned:
            ray.shutdown()
    return result


def _run_meta(cluster: dict) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout=10,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    accelerators = sorted(k.split(":", 1)[1] for k in cluster if k.startswith("accelerator_type:"))
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit or "unknown",
            "cluster": f"{cluster.get('CPU', 0):g} CPUs, {cluster.get('GPU', 0):g} GPUs"
                       + (f" ({', '.join(accelerators)})" if accelerators else "")}


# -- command line ---------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> SweepConfig:
    p = argparse.ArgumentParser(prog="python -m loadtests.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, dummy:Qwen3-8B, or a checkpoint folder")
    p.add_argument("--layouts", default="colo1,1p1d",
                   help="comma list: coloN, PpDd (1p1d, 2p3d), or auto (all that fill the GPUs)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rates", type=_floats, help="open loop: request rates (req/s), e.g. 1,2,4")
    load.add_argument("--users", type=_floats, help="closed loop: concurrent users, e.g. 1,4,16")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per point")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="open loop: seconds to wait for answers after the last send")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="fixed",
                   choices=["fixed", "uniform", "shared-prefix", "multi-turn"])
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=64)
    for name in ("input-min", "input-max", "output-min", "output-max", "prefix-len"):
        w.add_argument(f"--{name}", type=int, default=None)
    w.add_argument("--num-prefixes", type=int, default=4)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--num-requests", type=int, default=512,
                   help="closed loop: requests in the workload (cycled when used up)")
    w.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="auto: token ids for models without a tokenizer, text otherwise")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("SLOs (goodput)")
    s.add_argument("--slo-ttft-ms", type=float, required=True)
    s.add_argument("--slo-itl-ms", type=float, default=None,
                   help="bound on each request's mean inter-token gap (TPOT)")
    s.add_argument("--slo-itl-p99-ms", type=float, default=None,
                   help="bound on each request's own inter-token p99 (its stalls)")
    s.add_argument("--slo-attainment", type=float, default=0.9)
    d = p.add_argument_group("deployment")
    d.add_argument("--gpus-per-replica", type=float, default=0.0,
                   help="GPUs per prefill/decode replica (0: CPU; 0.5: two per GPU)")
    d.add_argument("--cpus-per-replica", type=float, default=0.5)
    d.add_argument("--engine", type=json.loads, default={},
                   help=f"EngineConfig overrides as JSON (CPU default {json.dumps(CPU_ENGINE)})")
    d.add_argument("--transfer-backend", default="auto")
    d.add_argument("--disaggregation", choices=["auto", "always", "never"], default="auto",
                   help="where a disaggregated layout prefills (the app's disaggregation.mode)")
    d.add_argument("--address", default=None,
                   help="join this Ray cluster (auto: the one running here) instead of starting "
                        "a local one; only the sweep's own app is removed from it")
    d.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray it starts")
    d.add_argument("--router-replicas", type=int, default=1,
                   help="ingress replicas of each layout's app")
    p.add_argument("--processes", type=int, default=1,
                   help="open loop: locust processes sharing each load, each on its own "
                        "schedule at rate/processes")
    d.add_argument("--request-timeout", type=float, default=300.0)
    d.add_argument("--deploy-timeout", type=float, default=900.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default results/<model>-<workload>-<time>)")
    a = p.parse_args(argv)
    spec = {k: getattr(a, k) for k in ("input_len", "output_len", "input_min", "input_max",
                                       "output_min", "output_max", "num_prefixes", "prefix_len",
                                       "turns", "num_requests", "seed")}
    out = a.out or Path("results") / (f"{a.model.replace(':', '-').replace('/', '_')}-"
                                      f"{a.workload}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        return _config(a, spec, out)
    except (ValidationError, ValueError) as exc:
        p.error(_messages(exc))


def _messages(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
    return str(exc)


def _config(a, spec: dict, out: Path) -> SweepConfig:
    return SweepConfig(
        model=a.model, layouts=[x for x in a.layouts.split(",") if x.strip()],
        rates=a.rates or [], users=[int(u) for u in a.users or []],
        duration_s=a.duration, drain_s=a.drain_timeout, protocol=a.protocol, arrival=a.arrival,
        workload=workloads.WorkloadSpec(kind=a.workload, **spec), prompt_format=a.prompt_format,
        slo=Slo(ttft_ms=a.slo_ttft_ms, itl_ms=a.slo_itl_ms, itl_p99_ms=a.slo_itl_p99_ms,
                attainment=a.slo_attainment),
        out=out, address=a.address, num_cpus=a.num_cpus,
        resources=Resources(num_gpus=a.gpus_per_replica, num_cpus=a.cpus_per_replica),
        engine=a.engine, transfer_backend=a.transfer_backend, disaggregation=a.disaggregation,
        request_timeout_s=a.request_timeout, deploy_timeout_s=a.deploy_timeout,
        temperature=a.temperature, router_replicas=a.router_replicas,
        processes=a.processes)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    result = run_sweep(cfg)
    print(f"\nreport: {cfg.out / 'summary.md'}")
    for failure in result.failures:
        print(f"FAILED {failure['layout']} {failure['load'] or ''}: {failure['error']}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
