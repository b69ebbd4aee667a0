"""Driving the roles as they ship (``PrefillServer``, ``DecodeServer``) outside Serve: stand-ins
for the prefill deployment's handle (in this process, or a role server in a child process), a
token sink collecting a request's tokens, and hooks that copy the KV a hand-over moved (the
source blocks just before they are released, the destination blocks just before admission).

Used by the transfer tests and ``benchmarks.disagg_parity``."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
import traceback

from contracts import GenerateRequest, TokenSink
from contracts.messages import GenerateResult, PrefillRequest, PrefillResult
from engine import EngineConfig, SamplingParams


# The roles' engine in these tests, and the requests they compare with the offline engine's.
ROLE_CONFIG = EngineConfig(model="tiny", num_blocks=256, max_num_seqs=8, show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def offline_tokens(prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """The offline engine's tokens for ``prompts`` (``tiny``)."""
    from engine import LLM

    return [o.token_ids for o in LLM("tiny").generate(prompts, params)]


class PrefillHandle:
    """Stands in for the prefill deployment's handle in one process: ``.prefill.remote(req)``
    runs ``server.prefill`` after ``delay`` seconds (or raises ``fail``; ``hang`` never
    answers); ``.first_token.remote(req)`` runs ``server.first_token`` alike (counted in
    ``first_token_calls``)."""

    def __init__(self, server=None, fail: Exception | None = None, hang: bool = False,
                 delay: float = 0.0):
        self.prefill = self
        self.server, self.fail, self.hang, self.delay = server, fail, hang, delay
        self.calls = 0
        self.answered = 0
        self.arrived: list[float] = []  # when each call reached the server
        self.hold_return: asyncio.Event | None = None  # set: calls return once it is set
        self.first_token_calls = 0
        self.first_token = _FirstTokenMethod(self)
        self.kv_load = _Probe(self)  # a trivial call: it answers unless failing or hanging

    def remote(self, req: PrefillRequest):
        self.calls += 1
        return self._call("prefill", req)

    def _call(self, method: str, req):
        async def call():
            if self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay)
            if self.fail is not None:
                raise self.fail
            self.arrived.append(time.time())
            try:
                result = await getattr(self.server, method)(req)
            finally:
                self.answered += 1
            if self.hold_return is not None:
                await self.hold_return.wait()
            return result
        return asyncio.ensure_future(call())


class _FirstTokenMethod:
    def __init__(self, handle: PrefillHandle):
        self.handle = handle

    def remote(self, req):
        self.handle.first_token_calls += 1
        return self.handle._call("first_token", req)


class _Probe:
    def __init__(self, handle: PrefillHandle):
        self.handle = handle

    def remote(self):
        async def call():
            if self.handle.fail is not None or self.handle.hang:
                raise ConnectionError("no prefill replica answers")
            return {}
        return asyncio.ensure_future(call())


async def generate(decode, sink: TokenSink, prompt: list[int], rid: str,
                   params: SamplingParams, arrivals: list[float] | None = None
                   ) -> tuple[list[int], GenerateResult]:
    """One request through ``decode.generate``: every token the sink received, and the result as
    it came on the channel behind them (the ingress's one path; asserted equal to the one
    ``generate`` returns). ``arrivals`` gets the ``time.time()`` at which each delta with tokens
    reached the sink."""
    tokens, ends, done = [], [], asyncio.Event()

    def on_delta(delta, _at):
        assert not ends, "a delta after the request's result"
        tokens.extend(delta.token_ids)
        if arrivals is not None and delta.token_ids:
            arrivals.append(time.time())

    def on_end(record):
        ends.append(GenerateResult.from_wire(record))
        done.set()

    sink.register(rid, on_delta, on_end)
    try:
        returned = await decode.generate(GenerateRequest(tuple(prompt), params, rid,
                                                         await sink.start()))
        await asyncio.wait_for(done.wait(), 30)
    finally:
        sink.unregister(rid)
    assert ends == [returned]
    return tokens, ends[0]


def run_to_idle(prefill, decode, prompt: list[int], rid: str,
                params: SamplingParams) -> tuple[list[int], GenerateResult]:
    """One request through ``decode`` (handing over to ``prefill``) on a sink of its own, both
    servers back to idle after it: :func:`generate`'s tokens and result."""
    async def run():
        sink = TokenSink()
        tokens, result = await generate(decode, sink, prompt, rid, params)
        await until_idle(prefill, decode)
        await sink.close()
        return tokens, result
    return asyncio.run(run())


def idle(server) -> bool:
    """No blocks used, no request in the engine, no lease."""
    engine = server.aengine.engine
    return engine.pool.num_used_blocks == 0 and not engine.has_unfinished_requests() and \
        (server.endpoint is None or server.endpoint.held_blocks == 0)


async def until_idle(*servers, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not all(idle(s) for s in servers):
        assert time.monotonic() < end, "not back to idle"
        await asyncio.sleep(0.02)


def capture_pushed_kv(prefill) -> dict:
    """From now on, keep a CPU copy of the source blocks of each push (request id → KV), taken
    as the push starts (the blocks are held, so they no longer change)."""
    ep, captured = prefill.endpoint, {}
    push = ep.push

    def copy_then_push(peer, dest, src_block_ids, on_finish=None):
        skip = dest.num_present_tokens // ep.layout.block_size
        sent = list(src_block_ids[skip:skip + len(dest.block_ids)])
        captured[dest.request_id] = ep.kv_cache[:, sent].cpu().clone()
        return push(peer, dest, src_block_ids, on_finish)

    ep.push = copy_then_push
    return captured


def capture_landed_kv(decode) -> dict:
    """From now on, keep a CPU copy of each request's destination blocks (request id → KV),
    taken on the engine thread just before the request is admitted (before decoding writes the
    next token's KV into its last block)."""
    engine, captured = decode.aengine.engine, {}
    admit = engine.admit

    def copy_then_admit(rid, *args):
        h = decode.handovers.get(rid)
        if h is not None:
            captured[rid] = decode.endpoint.kv_cache[:, list(h.dest.block_ids)].cpu().clone()
        return admit(rid, *args)

    engine.admit = copy_then_admit
    return captured


# -- a role server in a child process ---------------------------------------------------------
class NoPrefill:
    """The prefill handle of a decode server that only reserves (the test pushes itself)."""

    def __init__(self):
        self.prefill = self

    def remote(self, req):
        raise RuntimeError("this decode server has no prefill deployment")


def _serve(role: str, config: EngineConfig, backend: str, conn) -> None:
    asyncio.run(_serve_async(role, config, backend, conn))


async def _serve_async(role: str, config: EngineConfig, backend: str, conn) -> None:
    if role == "prefill":
        from prefill_worker.server import PrefillServer
        server = PrefillServer(config, backend)
        pushed = capture_pushed_kv(server)
    else:
        from decode_worker.placement import ALWAYS
        from decode_worker.server import DecodeServer
        server = DecodeServer(config, backend, NoPrefill(), disaggregation=ALWAYS)
    conn.send(server.endpoint.info())
    loop = asyncio.get_running_loop()
    while True:
        cmd, *args = await loop.run_in_executor(None, conn.recv)
        if cmd == "stop":
            server.close()
            conn.send("stopped")
            return
        try:
            if cmd == "prefill":  # PrefillRequest, delay -> (result, pushed source KV)
                req, delay = args
                await asyncio.sleep(delay)  # a slow (or soon killed) prefill replica
                result = await server.prefill(req)
                reply = result, pushed.pop(req.dest.request_id, None)
            elif cmd == "reserve":  # prompt, params, request id, timeout -> destination
                reply = await server.reserve(*args)
            elif cmd == "gauges":  # blocks under lease, blocks in use
                reply = server.endpoint.held_blocks, server.aengine.engine.pool.num_used_blocks
            elif cmd == "warm":  # a receiver's EndpointInfo -> its link's state (prefill only)
                reply = await warm_link(server, args[0])
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", reply))
        except Exception as exc:  # noqa: BLE001 - report to the parent
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))


async def warm_link(prefill, peer, timeout_s: float = 60.0) -> dict:
    """Warm the prefill server's link to ``peer`` as its ``LinkWarmer`` would (a directory
    listing only ``peer``); the link's state once settled: backend, state, seconds."""
    from kvtransfer.directory import DictStore, LinkWarmer, PeerDirectory

    directory = PeerDirectory("one", DictStore())
    directory.publish(peer)
    warmer = LinkWarmer(prefill.endpoint, directory, prefill.aengine.submit)
    warmer.scan()
    end = time.monotonic() + timeout_s
    while warmer.summary()[peer.endpoint_id]["state"] == "warming":
        assert time.monotonic() < end, "link not warmed in time"
        await asyncio.sleep(0.01)
    return warmer.summary()[peer.endpoint_id]


class PeerGone(ConnectionError):
    pass


class Peer:
    """The parent's handle on a role server in a child process (``info``: its endpoint)."""

    def __init__(self, role: str, config: EngineConfig, backend: str, start_s: float = 300):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # A split engine spawns its other ranks, which a daemon process may not do.
        daemon = config.tensor_parallel_size == 1
        self.proc = ctx.Process(target=_serve, args=(role, config, backend, child), daemon=daemon)
        self.proc.start()
        end = time.monotonic() + start_s
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise PeerGone(f"child role server exited with {self.proc.exitcode} while "
                               "starting")
            if time.monotonic() > end:
                self.kill()
                raise TimeoutError("child role server did not start")
        self.info = self.conn.recv()
        self._lock = threading.Lock()

    def call(self, cmd: str, *args, timeout: float = 60):
        with self._lock:
            try:
                self.conn.send((cmd, *args))
                if not self.conn.poll(timeout):
                    raise TimeoutError(f"child did not answer {cmd}")
                reply = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise PeerGone(f"child role server is gone ({type(exc).__name__})") from exc
        if reply[0] == "error":
            raise RuntimeError(f"{reply[1]}: {reply[2]}\n{reply[3]}")
        return reply[1]

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


class PeerPrefillHandle:
    """Stands in for the prefill deployment's handle, backed by a prefill server in a child
    process: a child that dies answers as a dead Serve replica does (``ActorDiedError``).
    ``pushed`` keeps the source KV of each push (request id → KV)."""

    def __init__(self, peer: Peer, delay: float = 0.0):
        self.prefill = self
        self.peer, self.delay = peer, delay
        self.pushed: dict = {}

    def remote(self, req: PrefillRequest):
        async def call() -> PrefillResult:
            try:
                result, kv = await asyncio.to_thread(self.peer.call, "prefill", req, self.delay)
            except PeerGone as exc:
                from ray.exceptions import ActorDiedError
                raise ActorDiedError() from exc
            self.pushed[req.dest.request_id] = kv
            return result
        return asyncio.ensure_future(call())
