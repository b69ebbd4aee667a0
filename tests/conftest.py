import os
from pathlib import Path

import pytest

# One cache of generated models for the whole run (tiny is built once, then reused).
os.environ.setdefault("BATON_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "baton"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    # The README's commands end with `ray stop` (every Ray on the machine): they run first,
    # before the session's own local Ray starts.
    items.sort(key=lambda item: "readme" not in item.keywords)
    # The fast tier (`make test-unit`): everything that needs no Ray, no GPU and no long wait.
    unit = pytest.mark.unit
    for item in items:
        if not {"e2e", "gpu", "slow", "readme"} & set(item.keywords):
            item.add_marker(unit)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for every test that needs it (started on first use)."""
    import ray

    from deploy import ray_env

    root = Path(__file__).resolve().parents[1]
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray-baton")
    ray_env.apply()
    # Serve's throughput profile buffers 1000 log lines per replica; tests read them at once.
    os.environ.setdefault("RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE", "1")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    from deploy.ray_env import free_port

    # address="local": a new instance even where another Ray runs on the machine (ray.init
    # would join one it finds, and refuse num_cpus). Replicas' metrics are exported on this
    # port (ray.init's default picks none), every second.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=free_port(),
             _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": {"PYTHONPATH": path,
                                       "BATON_CACHE": os.environ["BATON_CACHE"],
                                       "RAY_USAGE_STATS_ENABLED": "0"}})
    yield ray
    ray.shutdown()


def serve_log_dir() -> Path:
    """Where this session's Serve replicas write their logs."""
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"


def shutdown_serve(timeout_s: float = 90.0) -> None:
    """``serve.shutdown()``, then wait (bounded) until Serve's actors are gone and their CPUs are
    free: Ray ends a killed or draining replica a little after ``shutdown`` returns, and an actor
    the next test starts would otherwise wait for its CPUs. What is still there after the bound
    is printed (shown with a later failure)."""
    import time

    import ray
    from ray import serve
    from ray._private import state

    def leftovers() -> list[str]:
        # the proxy too (HAProxyManager): a serve.start while the old one is still being
        # killed takes it as its own (same name) and then sees it die (CI: "ActorDiedError:
        # HAProxyManager ... killed by ray.kill" in the next test's serve.start)
        return [f"{a['ActorClassName']}:{a['State']}:{a.get('Pid')}"
                for a in state.actors().values()
                if a["State"] != "DEAD" and ("Serve" in a["ActorClassName"]
                                             or "Proxy" in a["ActorClassName"])]

    serve.shutdown()
    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.time() + timeout_s
    while (leftovers() or ray.available_resources().get("CPU", 0.0) < total) \
            and time.time() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("CPU", 0.0)
    if free < total or leftovers():
        print(f"after serve.shutdown: {free:g} of {total:g} CPUs free; alive: {leftovers()}",
              flush=True)


def pytest_sessionfinish(session, exitstatus):
    session.config.baton_exit_status = int(exitstatus)


def pytest_unconfigure(config):
    """End without the interpreter's teardown once the report is out: transformers imports
    TorchDynamo, which imports Triton, whose bindings print ~25 lines of 'nanobind: leaked ...'
    at interpreter exit (noise that reads as a failure)."""
    import sys

    if "triton" in sys.modules and hasattr(config, "baton_exit_status"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.baton_exit_status)
