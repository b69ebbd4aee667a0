"""`baton serve`'s start-up lines from Serve's status (a failed deployment ends it with Serve's
message); a running app is checked against real Serve in test_metrics_e2e. The demo's Ray."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from deploy.cli import main, startup_summary

ROOT = Path(__file__).resolve().parents[1]


def _status(app_state: str, message: str = "", **deployments) -> NS:
    deps = {name: NS(replica_states=states) for name, states in deployments.items()}
    return NS(applications={"baton": NS(status=app_state, message=message, deployments=deps)})


def test_starting_replicas_are_counted_apart_from_running_ones():
    line, failed = startup_summary(
        _status("DEPLOYING", Router={"RUNNING": 1}, DecodeServer={"STARTING": 2, "RUNNING": 1}),
        ["baton"])
    assert failed is None
    assert line == "baton deploying: Router 1/1, DecodeServer 1/3 (2 starting)"


def test_a_failed_deployment_carries_serves_message():
    line, failed = startup_summary(
        _status("DEPLOY_FAILED", "DecodeServer: CUDA out of memory", DecodeServer={}),
        ["baton"])
    assert line.startswith("baton deploy_failed: DecodeServer 0/0")
    assert failed == "baton: DecodeServer: CUDA out of memory"


@pytest.mark.e2e
def test_the_demo_starts_its_own_ray_beside_a_stale_cluster_address():
    """`ray.init` without an address joins the cluster named in `ray_current_cluster` and then
    refuses num_cpus; the demo (and the tests' own Ray, through the same call) starts a new
    instance whatever that file says. Run apart: this process may hold the tests' Ray."""
    tmp = Path(tempfile.mkdtemp(prefix="rayc", dir="/tmp"))  # short: Ray's socket paths
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing listens
    code = ("from deploy.cli import _start_ray; _start_ray(num_cpus=2); import ray; "
            "print('cpus', ray.cluster_resources()['CPU']); ray.shutdown()")
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    shutil.rmtree(tmp, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cpus 2.0" in run.stdout


def test_generate_runs_fp8_weights_and_cache_from_the_command_line(capsys):
    from deploy.cli import main

    assert main(["generate", "The quick brown fox", "--max-tokens", "4", "--quantization",
                 "fp8", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "weights fp8 (on-the-fly, channel), KV cache float8_e4m3fn" in out
    assert "4 tokens" in out


@pytest.mark.parametrize("flags", [["--decode", "0"], ["--prefill", "-1"],
                                   ["--tensor-parallel-size", "0"]])
def test_pool_sizes_below_their_least_are_refused_by_the_parser(flags, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "tiny", *flags])
    assert "at least" in capsys.readouterr().err
