"""A newcomer's path: `baton serve tiny` in one line on a local Ray of its own, beside the
test cluster (which it must not join or touch); a streamed answer through the official `openai`
client; Ctrl-C stops everything it started. Every local cluster gets its own free ports for the
listeners Serve opens besides the app's (HAProxy's stats and metrics, Serve's fallback proxy), so
two apps on one machine never answer each other's requests."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy import ray_env
from deploy.cli import open_without_key_warning, serve_config_from_flags

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_every_local_cluster_gets_its_own_serve_ports(monkeypatch):
    """Serve's fallback proxy defaults to 8500/9500 on every cluster, so HAProxy of one app fell
    back to another app's proxy. A local cluster now takes free ports, fresh ones even where the
    parent process already set some (a child's cluster is another cluster)."""
    if not ray_env.haproxy_available():
        pytest.skip("HAProxy not installed: no HAProxy listeners, no fallback proxy ports")
    first, second = ray_env.local_env(), ray_env.local_env()
    for key in ray_env.PORTS:
        assert first[key] != second[key] and int(first[key]) not in (8404, 9101, 8500, 9500)
    monkeypatch.setenv("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "8500")  # the parent's choice
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")  # a user's setting
    applied = ray_env.apply()
    assert applied["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] != "8500"
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"


def test_one_line_configs_and_the_open_port_warning():
    args = type("A", (), dict(model="tiny", prefill=0, decode=2, gpus_per_replica=None,
                              host="0.0.0.0", port=8000, grpc_port=9000, grpc_reflection=False,
                              served_model_name=None, max_model_len=None, max_num_seqs=8,
                              quantization=None, kv_cache_dtype="fp8",
                              tensor_parallel_size=2, prefill_autoscaling=None,
                              decode_autoscaling=None, disaggregation="auto",
                              max_local_prefill_length=None, itl_target_ms=None,
                              api_server_count=2))()
    config = serve_config_from_flags(args)
    app = config["applications"][0]["args"]
    assert app["mode"] == "colocated" and app["decode"]["num_replicas"] == 2
    assert app["engine"]["kv_cache_dtype"] == "fp8" and "prefill" not in app
    assert app["engine"]["tensor_parallel_size"] == 2
    assert app["router"] == {"num_replicas": 2}  # --api-server-count: an ingress death is survived
    from deploy.config import BatonConfig
    assert BatonConfig(**app).engine_for("decode").tensor_parallel_size == 2
    split = BatonConfig(**{**app, "mode": "disaggregated"})  # both roles over 2 ranks
    assert split.engine_for("prefill").tensor_parallel_size == 2
    assert config["grpc_options"]["enable_reflection"] is False
    assert "no API key" in open_without_key_warning(config)
    app["router"]["api_key"] = "k"
    assert open_without_key_warning(config) is None
    config["http_options"]["host"] = "127.0.0.1"
    del app["router"]["api_key"]
    assert open_without_key_warning(config) is None
    args.prefill, args.decode_autoscaling = 1, '{"min_replicas": 1, "max_replicas": 3}'
    app = serve_config_from_flags(args)["applications"][0]["args"]
    assert app["decode"]["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3}
    assert "num_replicas" not in app["decode"] and app["prefill"]["num_replicas"] == 1
    BatonConfig(**app)
    args.itl_target_ms, args.kv_offloading_size = 20.0, 4.0  # --itl-target-ms, ...
    app = serve_config_from_flags(args)["applications"][0]["args"]
    assert BatonConfig(**app).disaggregation.itl_target_ms == 20.0
    assert BatonConfig(**app).engine.kv_offloading_size == 4.0
    # --speculative-config: the decode role speculates; a prefill replica (one token a
    # request) loads no draft
    args.speculative_config = '{"method": "draft_model", "model": "tiny", ' \
        '"num_speculative_tokens": 4}'
    split = BatonConfig(**serve_config_from_flags(args)["applications"][0]["args"])
    assert split.engine_for("decode").speculative_config.model == "tiny"
    assert split.engine_for("prefill").speculative_config is None
    # --generation-config, --override-generation-config (vLLM's): the engine's settings, which
    # the ingress reads (tests/test_generation_config.py)
    args.generation_config, args.override_generation_config = "vllm", '{"temperature": 0.5}'
    engine = BatonConfig(**serve_config_from_flags(args)["applications"][0]["args"]).engine
    assert (engine.generation_config, engine.override_generation_config) == \
        ("vllm", {"temperature": 0.5})
    args.override_generation_config = '{"temperature": 0.5'
    with pytest.raises(SystemExit, match="--override-generation-config is not JSON"):
        serve_config_from_flags(args)
    args.override_generation_config, args.decode_autoscaling = None, '{"min_replicas": 1'
    with pytest.raises(SystemExit, match="--decode-autoscaling is not JSON"):
        serve_config_from_flags(args)


def _listening(proc) -> set[tuple[str, int]]:
    """(address, port) of every socket ``proc`` listens on (none if it is gone)."""
    from ray.thirdparty_files import psutil

    try:
        return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        return set()


def _listeners(title: str) -> set[tuple[str, int]]:
    """(address, port) of every socket the processes titled ``...title...`` listen on."""
    from ray.thirdparty_files import psutil

    return {addr for proc in psutil.process_iter(["cmdline"])
            if title in " ".join(proc.info["cmdline"] or ()) for addr in _listening(proc)}


def _haproxy(port: int) -> tuple[set[tuple[str, int]], set[int]]:
    """The HAProxy serving ``port``: (address, port) of every socket it listens on, and the
    ports of the servers its configuration forwards to."""
    from ray.thirdparty_files import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        if "haproxy" not in (proc.info["name"] or ""):
            continue
        found = _listening(proc)
        if any(p == port for _, p in found):
            args = proc.info["cmdline"]
            config = Path(args[args.index("-f") + 1]).read_text()
            servers = re.findall(r"^\s*server \S+ [^\s:]+:(\d+)", config, re.MULTILINE)
            return found, {int(p) for p in servers}
    raise AssertionError(f"no HAProxy listens on {port}")


def readme_python_blocks() -> list[str]:
    """The README's Python client examples (the ```python blocks of its "Serving" section)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Serving"):text.index("With Ray's own")]
    return [part.split("```", 1)[0] for part in section.split("```python\n")[1:]]


def _lines(proc, seen: list[str]) -> None:
    for line in proc.stdout:
        seen.append(line)


@pytest.mark.e2e
def test_baton_serve_tiny_streams_to_the_openai_client_and_ctrl_c_stops_it(ray_cluster, tmp_path):
    from openai import OpenAI

    http, grpc_port = ray_env.free_port(), ray_env.free_port()
    # a home of its own: the token file its local Ray writes is this test's to check
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "HOME": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    # --override-generation-config: the served defaults of the sampling fields (vLLM's; the
    # README's examples set their own, which max_new_tokens caps)
    proc = subprocess.Popen(
        [str(BIN / "baton"), "serve", "tiny", "--port", str(http), "--grpc-port",
         str(grpc_port), "--max-num-seqs", "8", "--timeout", "240",
         "--override-generation-config", '{"temperature": 0, "max_new_tokens": 6}'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    seen: list[str] = []
    threading.Thread(target=_lines, args=(proc, seen), daemon=True).start()
    try:
        deadline = time.time() + 300
        while not any(line.startswith("serving tiny") for line in seen):
            assert proc.poll() is None, "".join(seen)
            assert time.time() < deadline, "".join(seen)
            time.sleep(0.5)
        assert f"http://127.0.0.1:{http}/v1" in "".join(seen)
        # Ray's token file, which turns token authentication on for a later `ray start`: its
        # owner's only (Ray writes it 0644)
        token = tmp_path / ".ray" / "auth_token"
        assert token.exists() and token.stat().st_mode & 0o777 == 0o600
        # HAProxy, in front of the app's HTTP port, listens only on loopback: its stats and
        # metrics listeners too (Ray's template binds them to every interface).
        # and so do the ingress replicas' own HTTP and gRPC servers that HAProxy forwards to
        # (two replicas, --api-server-count's default; their other ports are Ray's own). HAProxy
        # learns of each replica on its own schedule: wait, bounded, until it has both.
        deadline = time.time() + 60
        while True:
            listening, backends = _haproxy(http)
            direct = {(ip, port) for ip, port in _listeners("ServeReplica:baton:Router")
                      if port in backends}
            if len(direct) >= 2 * 2 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert len(listening) >= 3 and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        assert len(direct) == 2 * 2 and {ip.removeprefix("::ffff:") for ip, _ in direct} == \
            {"127.0.0.1"}, (direct, backends)
        client = OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny"]
        chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox",
                                                max_tokens=8, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        # a request that leaves temperature and max_tokens unset gets the served defaults:
        # greedy, 6 tokens, as one that sets them
        unset = client.completions.create(model="tiny", prompt="The quick brown fox",
                                          extra_body={"ignore_eos": True})
        given = client.completions.create(model="tiny", prompt="The quick brown fox",
                                          max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert unset.usage.completion_tokens == given.usage.completion_tokens == 6
        assert unset.choices[0].text == given.choices[0].text
        # the README's client examples (OpenAI, gRPC), as written but for the ports
        for code in readme_python_blocks():
            code = code.replace("8000", str(http)).replace("9000", str(grpc_port))
            run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120,
                                 capture_output=True, text=True)
            assert run.returncode == 0 and run.stdout.strip(), run.stdout + run.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, "".join(seen)
    assert "stopping" in "".join(seen)
    with pytest.raises(OSError):  # its HTTP port is closed
        import socket
        socket.create_connection(("127.0.0.1", http), timeout=2).close()


@pytest.mark.parametrize("host, rebound", [("127.0.0.1", True), ("::1", True),
                                           ("0.0.0.0", False)])
def test_haproxy_wrapper_rebinds_stats_and_metrics_only_for_a_loopback_frontend(tmp_path, host,
                                                                               rebound):
    """``deploy/haproxy_local.sh`` on a config as Ray's template writes it: the two listeners
    without a host follow a loopback HTTP frontend, and its connect timeouts become 250 ms (a
    request that met a dead server is retried after min(connect timeout, 1 s)); a frontend on
    every interface keeps them as they were; either way the HTTP frontend buffers requests
    (so that one whose replica died can be resent); the real binary then runs with the same
    arguments."""
    config = tmp_path / "haproxy.cfg"
    text = ("defaults\n    mode http\n    timeout connect 5s\n"
            "frontend prometheus\n    bind :41001\n    mode http\n"
            f"frontend http_frontend\n    bind {host}:8000\n    mode http\n"
            "backend http-app\n    timeout connect 5s\n"
            "listen stats\n  bind *:41002\n  stats enable\n")
    config.write_text(text)
    seen = tmp_path / "args"
    fake = tmp_path / "haproxy"
    fake.write_text(f'#!/bin/sh\necho "$@" > {seen}\n')
    fake.chmod(0o755)
    run = subprocess.run([str(ray_env.HAPROXY_WRAPPER), "-db", "-f", str(config), "-sf", "7"],
                         env={**os.environ, "BATON_HAPROXY_BINARY": str(fake)}, timeout=30)
    assert run.returncode == 0
    assert seen.read_text().split() == ["-db", "-f", str(config), "-sf", "7"]
    binds = re.findall(r"bind (\S+)", config.read_text())
    if rebound:
        assert binds == [f"{host}:41001", f"{host}:8000", f"{host}:41002"]
        assert re.findall(r"timeout connect (\S+)", config.read_text()) == ["250ms", "250ms"]
    else:  # only the buffering that lets HAProxy resend a request (deploy/haproxy_local.sh)
        assert config.read_text() == text.replace(
            "frontend http_frontend\n", "frontend http_frontend\n    option http-buffer-request\n")
