import os
from pathlib import Path

import pytest

# One cache of generated models for the whole run (tiny is built once, then reused).
os.environ.setdefault("BATON_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "baton"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
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
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path,
                                       "BATON_CACHE": os.environ["BATON_CACHE"],
                                       "RAY_USAGE_STATS_ENABLED": "0"}})
    yield ray
    ray.shutdown()


def shutdown_serve(timeout_s: float = 60.0) -> None:
    """``serve.shutdown()``, then wait (bounded) until the replicas' CPUs are free again: Ray
    frees a killed replica's resources a little after ``shutdown`` returns, and an actor the next
    test starts would otherwise wait for them."""
    import time

    import ray
    from ray import serve

    serve.shutdown()
    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.time() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < total and time.time() < deadline:
        time.sleep(0.2)
