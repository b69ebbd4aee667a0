"""A prefill or decode engine in a child process, driven over a pipe (transfer tests and
benchmarks), and helpers that run one hand-over."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

from engine import Completion, EngineConfig


def _serve(role: str, config: EngineConfig, backend: str, conn) -> None:
    if role == "prefill":
        from prefill_worker.core import PrefillCore as Core
    else:
        from decode_worker.core import DecodeCore as Core
    core = Core(config, backend)
    conn.send(core.info())
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            core.close()
            conn.send("stopped")
            return
        try:
            conn.send(("ok", _handle(core, cmd, args)))
        except Exception as exc:  # noqa: BLE001 - report to the test
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))


def _handle(core, cmd: str, args):
    if cmd == "prefill":  # prompt, params, dest, peer -> (result, source KV of the pushed blocks)
        prompt, params, dest, peer, delay = args
        if delay:
            time.sleep(delay)  # a slow (or soon killed) prefill
        return prefill_capturing_kv(core, prompt, params, dest, peer)
    if cmd == "begin":  # decode: prompt, params, timeout -> destination
        prompt, params, timeout = args
        return core.begin(prompt, params, timeout_s=timeout)
    if cmd == "gauges":
        return core.endpoint.held_blocks, core.engine.pool.num_used_blocks
    raise ValueError(f"unknown command {cmd}")


def prefill_capturing_kv(core, prompt, params, dest, peer):
    """``core.prefill`` that also returns a copy of the source KV it pushed (taken just before
    the source blocks are released)."""
    original = core.engine.release_held_blocks
    captured = {}

    def capture_then_release(rid):
        blocks = core.engine.held_blocks(rid)
        skip = dest.num_present_tokens // core.engine.config.block_size
        captured["kv"] = core.endpoint.kv_cache[:, blocks[skip:]].cpu().clone()
        original(rid)

    core.engine.release_held_blocks = capture_then_release
    try:
        return core.prefill(prompt, params, dest, peer), captured.get("kv")
    finally:
        core.engine.release_held_blocks = original


def finish(engine, first_output) -> Completion:
    """Step ``engine`` until the request of ``first_output`` (from ``admit``) finishes; all of
    its output tokens."""
    rid, out = first_output.request_id, first_output
    result = Completion(rid, [], token_ids=list(out.new_token_ids))
    while not out.finished:
        for o in engine.step():
            if o.request_id == rid:
                result.token_ids += o.new_token_ids
                out = o
    result.finished, result.finish_reason = True, out.finish_reason
    return result


class Peer:
    """The parent's handle on a child engine."""

    def __init__(self, role: str, config: EngineConfig, backend: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(role, config, backend, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError("child engine did not start")
        self.info = self.conn.recv()

    def call(self, cmd: str, *args, timeout: float = 60):
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"child did not answer {cmd}")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"{reply[1]}: {reply[2]}\n{reply[3]}")
        return reply[1]

    def send(self, cmd: str, *args) -> None:
        """Fire and forget (for a call the test will interrupt by killing the child)."""
        self.conn.send((cmd, *args))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.poll(10)
            except (BrokenPipeError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
