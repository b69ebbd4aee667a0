"""The ingress's view of a request (no Ray): what arrived since the writer's last turn leaves as
one chunk, a stop string ends the text and cancels the decode call, a failed call or a deadline
ends the stream with an error instead of a hang."""

import asyncio
import time

import pytest

from contracts import TokenDelta
from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.model_source import load_tokenizer, resolve_model
from router.ingress.streams import RequestStream, RequestTimeout


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("tiny"))


class FakeCall:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


def _stream(tok, **params):
    p = SamplingParams(**params)
    s = RequestStream("r", 4, p, IncrementalDetokenizer(tok, p.stop))
    s.call = FakeCall()
    return s


async def _collect(stream, deadline_s=5.0):
    return [c async for c in stream.chunks(time.monotonic() + deadline_s)]


def test_tokens_that_arrive_together_leave_as_one_chunk(tok):
    async def main():
        ids = tok.encode("one two three four", add_special_tokens=False)
        s = _stream(tok, max_tokens=len(ids), logprobs=True)
        for i, t in enumerate(ids[:-1]):  # several steps before the writer's first turn
            s.feed(TokenDelta("r", [t], [-float(i)], num_output_tokens=i + 1), 10.0 + i)
        first = await s.chunks(time.monotonic() + 5).__anext__()
        assert first.token_ids == ids[:-1] and first.produced_at == 10.0
        assert first.logprobs == [-float(i) for i in range(len(ids) - 1)]
        s.feed(TokenDelta("r", [ids[-1]], [-9.0], "length", None, len(ids)), 20.0)
        rest = await _collect(s)
        assert len(rest) == 1 and rest[0].finish_reason == "length"
        assert first.text + rest[0].text == "one two three four"
        assert not s.call.cancelled

    asyncio.run(main())


def test_a_stop_string_ends_the_text_and_cancels_the_call(tok):
    async def main():
        ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
        s = _stream(tok, max_tokens=100, stop=["gamma"])
        for i, t in enumerate(ids):
            s.feed(TokenDelta("r", [t], num_output_tokens=i + 1), 1.0)
        chunks = await _collect(s)
        assert "".join(c.text for c in chunks) == "alpha beta "
        assert s.finish_reason == "stop" and s.stop_reason == "gamma" and s.call.cancelled
        assert "gamma" in tok.decode(s.token_ids) and len(s.token_ids) < len(ids)

    asyncio.run(main())


def test_a_failed_call_ends_the_stream_with_its_error(tok):
    async def main():
        s = _stream(tok)
        s.feed(TokenDelta("r", [tok.encode("x", add_special_tokens=False)[0]],
                          num_output_tokens=1), 1.0)
        s.fail(ValueError("prompt: too long"))
        with pytest.raises(ValueError, match="too long"):
            await _collect(s)

    asyncio.run(main())


def test_a_stream_past_its_deadline_times_out(tok):
    async def main():
        s = _stream(tok)
        with pytest.raises(RequestTimeout):
            await _collect(s, deadline_s=0.2)

    asyncio.run(main())


def test_a_request_not_started_within_its_bound_is_refused_with_a_retry_hint(tok):
    """No first token by ``start_by``: NotStarted, answered 429 / RESOURCE_EXHAUSTED with
    Retry-After; a stream that has started is bound by its deadline only."""
    import grpc

    from router.ingress.errors import NotStarted, describe

    async def main():
        s = _stream(tok)
        s.start_by = time.monotonic() + 0.2
        t0 = time.monotonic()
        with pytest.raises(NotStarted) as err:
            await _collect(s, deadline_s=5.0)
        assert 0.15 < time.monotonic() - t0 < 1.0
        failure = describe(err.value, "r")
        assert (failure.status, failure.code, failure.retry_after) == \
            (429, grpc.StatusCode.RESOURCE_EXHAUSTED, 5)
        assert "queue-time bound" in failure.message
        started = _stream(tok)
        started.start_by = time.monotonic() + 0.1
        started.feed(TokenDelta("r", [5], num_output_tokens=1), 1.0)

        async def finish_later():
            await asyncio.sleep(0.4)
            started.feed(TokenDelta("r", [6], None, "length", num_output_tokens=2), 1.0)
        asyncio.ensure_future(finish_later())
        chunks = await _collect(started, deadline_s=5.0)
        assert chunks[-1].finish_reason == "length"

    asyncio.run(main())


def test_bad_request_is_the_only_400():
    """A BadRequest (whoever raised it) and a request model's validation error are 400; a
    ValueError from anywhere else is the server's fault: 500, its traceback in the log."""
    from pydantic import BaseModel, ValidationError

    from engine.errors import BadRequest
    from router.ingress.errors import describe

    class M(BaseModel):
        x: int

    try:
        M(x="no")
    except ValidationError as exc:
        invalid = exc
    assert describe(BadRequest("prompt: must not be empty"), "r").status == 400
    assert describe(invalid, "r").status == 400
    assert describe(ValueError("a bug"), "r").status == 500
    assert describe(ValueError("a bug"), "r").internal


class _Call:
    """A Serve call as the ingress sees it: awaitable, cancellable."""

    def __init__(self, fut):
        self.fut = fut

    def __await__(self):
        return self.fut.__await__()

    def cancel(self):
        self.fut.cancel()


class _Handle:
    """The decode deployment's handle, calling a DecodeServer in this process (``silent``: the
    first call returns at once and sends nothing, as one whose channel broke after it)."""

    def __init__(self, server, silent_first: bool = False):
        self.server, self.calls, self.silent_first = server, [], silent_first
        self.generate = self

    def remote(self, req):
        self.calls.append(req)
        if self.silent_first and len(self.calls) == 1:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return _Call(fut)
        return _Call(asyncio.ensure_future(self.server.generate(req)))


@pytest.fixture(scope="module")
def decode_server():
    from decode_worker.placement import ALWAYS
    from decode_worker.server import DecodeServer
    from engine import EngineConfig

    server = DecodeServer(EngineConfig(model="tiny", num_blocks=64, show_progress=False),
                          "local", disaggregation=ALWAYS)
    yield server
    server.close()


def test_the_answer_comes_back_on_the_channel_only(tok, decode_server):
    """DecodeClient against a real decode server (no Ray): the tokens and then the result
    arrive on the token channel (the call's own return value is not read); bad input only the
    replica can check ends the stream with BadRequest; a stream whose call ended but whose
    channel dropped before its last tokens is moved (called again) and completes."""
    from engine import LLM
    from engine.errors import BadRequest
    from router.ingress.streams import DecodeClient

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = tok.encode("The answer comes back", add_special_tokens=False)
    want = LLM("tiny").generate([prompt], params)[0].token_ids

    async def main():
        client = DecodeClient(_Handle(decode_server), tok)
        stream = await client.start(prompt, params, "a")
        stream.deadline = time.monotonic() + 30
        got = [t for c in [c async for c in stream.chunks(stream.deadline)] for t in c.token_ids]
        result = await client.result(stream)
        assert got == want and result.num_output_tokens == 10 and result.finish_reason == "length"

        too_long = await client.start(list(range(1, 100)) * 40, params, "b")
        with pytest.raises(BadRequest, match="leave no room"):
            await _collect(too_long, deadline_s=30)

        handle = _Handle(decode_server, silent_first=True)
        client = DecodeClient(handle, tok)
        moved = await client.start(prompt, params, "c")
        moved.deadline = time.monotonic() + 30
        await moved.call_done.wait()
        await client._channel_lost(moved, "c")
        got = [t for c in [c async for c in moved.chunks(moved.deadline)] for t in c.token_ids]
        assert got == want and len(handle.calls) == 2 and moved.migrations == 1
        await client.sink.close()

    asyncio.run(main())


def test_a_request_moved_while_its_lost_channel_waits_to_move_it_moves_once(tok, decode_server):
    """Its call returned, then its channel dropped: the move waits a back-off, during which the
    request is moved by another path (its decode pool found down). It is then moved no more
    (one new call, the offline tokens once), and the new call can be cancelled (its
    ``call_done`` is that call's, not the returned one's)."""
    from engine import LLM
    from router.ingress.streams import DecodeClient

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = tok.encode("Moved once", add_special_tokens=False)
    want = LLM("tiny").generate([prompt], params)[0].token_ids

    async def main():
        handle = _Handle(decode_server, silent_first=True)
        client = DecodeClient(handle, tok)
        stream = await client.start(prompt, params, "m")
        stream.deadline = time.monotonic() + 30
        await stream.call_done.wait()
        lost = asyncio.ensure_future(client._channel_lost(stream, "m"))
        await asyncio.sleep(0)  # in its back-off now
        client._move(stream, "decode pool down")
        assert not stream.call_done.is_set()  # the new call runs: cancel() would reach it
        await lost
        got = [t for c in [c async for c in stream.chunks(stream.deadline)] for t in c.token_ids]
        assert got == want and len(handle.calls) == 2 and stream.migrations == 1
        await client.sink.close()

    asyncio.run(main())


class _LostCancel(_Handle):
    """A decode handle whose calls' cancel Serve drops (it came while the call was being handed
    to its replica)."""

    def remote(self, req):
        call = super().remote(req)
        call.cancel = lambda: None
        return call


def test_a_stop_string_stops_the_engine_when_serve_drops_the_calls_cancel(tok, decode_server):
    """The stop string ends the stream at the ingress, which cancels its call; Serve drops that
    cancel (best effort), but the same word on the token channel stops the request on the
    decode replica: it makes a few tokens, not ``max_tokens``, and holds no block after."""
    from engine import LLM
    from router.ingress.streams import DecodeClient

    prompt = tok.encode("A stop string stops it", add_special_tokens=False)
    params = dict(temperature=0, max_tokens=1500, ignore_eos=True)
    text = LLM("tiny").generate([prompt], SamplingParams(**{**params, "max_tokens": 20}))[0].text
    engine = decode_server.aengine.engine

    async def main():
        client = DecodeClient(_LostCancel(decode_server), tok)
        before = engine.stats.output_tokens
        stop = text[5:8]
        stream = await client.start(prompt, SamplingParams(**params, stop=[stop]), "s")
        chunks = await _collect(stream, deadline_s=30)
        assert "".join(c.text for c in chunks) == text[:text.find(stop)]
        assert stream.finish_reason == "stop"
        client.close(stream)
        end = time.monotonic() + 10
        while engine.has_unfinished_requests() and time.monotonic() < end:
            await asyncio.sleep(0.02)
        assert engine.stats.output_tokens - before < 100 and engine.pool.num_used_blocks == 0
        await client.sink.close()

    asyncio.run(main())


class _QueuedCall:
    """A Serve call waiting in the handle's queue: no replica has taken it (yet)."""

    def __init__(self):
        self._done = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def __await__(self):
        return self._done.__await__()

    def cancel(self):
        self.cancelled = True
        self._done.cancel()


class _Pool:
    """A decode deployment's handle whose calls stay queued; ``alive``: its replicas answer a
    trivial call (they are full, not gone)."""

    def __init__(self, alive: bool):
        self.generate, self.kv_load, self.alive, self.calls = self, _Ping(self), alive, []

    def remote(self, req):
        self.calls.append(_QueuedCall())
        return self.calls[-1]


class _Ping:
    def __init__(self, pool):
        self.pool = pool

    def remote(self):
        async def ping():
            if not self.pool.alive:
                raise ConnectionError("no decode replica")
            return {}
        return asyncio.ensure_future(ping())


@pytest.mark.parametrize("alive", [True, False])
def test_a_request_no_replica_takes_in_time_is_refused_at_once(tok, alive):
    """router.queue_timeout_s: a request still in Serve's queue then gets 429 "at capacity" at
    once and its queued call is cancelled; in a disaggregated app whose decode replicas are all
    gone it goes to the prefill replicas instead (the fallback). A call a replica has taken
    (it sends an empty first delta) is never refused so."""
    import grpc

    from router.ingress.errors import AtCapacity, describe
    from router.ingress.streams import DecodeClient

    async def main():
        pool, fallback = _Pool(alive), _Pool(True)
        client = DecodeClient(pool, tok, queue_timeout_s=0.2, fallback=fallback)
        stream = await client.start([5, 6, 7], SamplingParams(max_tokens=4), "q")
        taken = await client.start([5, 6, 7], SamplingParams(max_tokens=4), "t")
        taken.feed(TokenDelta("t", []), time.time())  # a replica took it (its empty delta)
        t0 = time.monotonic()
        if alive:
            with pytest.raises(AtCapacity) as err:
                await _collect(stream, deadline_s=5.0)
            assert time.monotonic() - t0 < 1.0 and pool.calls[0].cancelled
            failure = describe(err.value, "q")
            assert (failure.status, failure.code, failure.retry_after) == \
                (429, grpc.StatusCode.RESOURCE_EXHAUSTED, 1)
            assert "at capacity" in failure.message
            assert taken.error is None and not pool.calls[1].cancelled
        else:
            while not fallback.calls:
                await asyncio.sleep(0.05)
            assert time.monotonic() - t0 < 2.5 and stream.error is None
            assert stream.pool is fallback and client.decode_down  # every stream moved
        await client.sink.close()

    asyncio.run(main())


def test_a_role_is_full_only_while_every_live_replica_holds_its_bound(monkeypatch):
    """contracts.role.role_full, over fake replica actors: full when each answers with its bound
    (or is too busy to answer); not while one has room (a replica still starting says 0), nor
    with none listed (restarting: the request waits for it)."""
    import contracts.role as role

    class Actor:
        def __init__(self, ongoing):
            self.get_num_ongoing_requests, self.ongoing = self, ongoing

        def remote(self):
            async def answer():
                if self.ongoing is None:
                    await asyncio.sleep(10)  # busy
                return self.ongoing
            return asyncio.ensure_future(answer())

    listed = []
    monkeypatch.setattr(role, "replica_actor_prefix", lambda handle: "SERVE_REPLICA::x#")
    monkeypatch.setattr(role, "replica_actors", lambda prefix: listed)

    async def full(*ongoing) -> bool:
        listed[:] = [Actor(n) for n in ongoing]
        return await role.role_full(object(), 4, 0.2)

    async def main():
        assert await full(4, 5) and await full(4, None) and await full(None)
        assert not await full(4, 0) and not await full()

    asyncio.run(main())


def test_a_registry_that_does_not_answer_is_not_known_and_waits_no_longer(monkeypatch):
    """The cluster's registry (the listing of a role's replica actors) hangs: each question
    about the role gives its "not known" answer once ``REGISTRY_TIMEOUT_S`` has passed (alive,
    not gone, not full), instead of waiting with it."""
    import time

    import contracts.role as role

    def hung(prefix):
        time.sleep(1.0)
        return []

    monkeypatch.setattr(role, "replica_actor_prefix", lambda handle: "SERVE_REPLICA::x#")
    monkeypatch.setattr(role, "replica_actors", hung)
    monkeypatch.setattr(role, "REGISTRY_TIMEOUT_S", 0.1)

    async def main():
        start = time.monotonic()
        assert await role.any_replica_answers(object(), 0.2)
        assert not await role.role_gone(object(), 0.2)
        assert not await role.role_full(object(), 4, 0.2)
        assert time.monotonic() - start < 0.6

    asyncio.run(main())


class _Pool2:
    """A deployment handle whose calls fail at once (``fail``) or stay pending (recorded)."""

    def __init__(self, fail: BaseException | None = None):
        self.generate, self.fail, self.calls = self, fail, []

    def remote(self, req):
        fut = asyncio.get_running_loop().create_future()
        if self.fail is not None:
            fut.set_exception(self.fail)
        self.calls.append((req, fut))
        return fut


def test_a_request_moved_while_its_lost_call_is_followed_is_not_failed_by_it(tok):
    """Its decode call is lost with the replica; the check that follows finds the decode pool
    down and moves every request on it, this one too, to the prefill replicas. The lost call's
    follower must then leave it to its new call, even when it could not have moved it itself
    (its deadline within the back-off): not failed with the old call's error, and its new call
    cancelled when the client goes (before, the stream failed and its new call ran on, unread)."""
    from ray.exceptions import ActorDiedError

    from router.ingress.streams import DecodeClient

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main():
        decode, prefill = _Pool2(ActorDiedError()), _Pool2()
        client = DecodeClient(decode, tok, fallback=prefill)

        async def down():
            return False
        client._decode_alive = down
        stream = await client.start([5, 6, 7], params, "a")
        stream.deadline = time.monotonic() + 0.03  # within the first back-off (0.05 s)
        for _ in range(50):
            await asyncio.sleep(0.01)
            if prefill.calls:
                break
        await asyncio.sleep(0.1)
        assert stream.call_id == "a~1" and len(prefill.calls) == 1 and stream.error is None
        client.close(stream)
        assert prefill.calls[0][1].cancelled()
        await client.sink.close()

    asyncio.run(main())


def test_a_call_no_replica_takes_is_asked_about_until_the_pool_is_found_down(tok, monkeypatch):
    """A decode call no replica has taken (Serve holds it: the pool's only replica is still
    starting), for a request moved there with tokens already: the ingress asks whether any
    decode replica is alive every ``DECODE_SILENT_S`` until one takes it, and moves the request
    to the prefill replicas once none answers (before, it asked once, and never for a request
    with tokens)."""
    import router.ingress.streams as streams
    from router.ingress.streams import DecodeClient

    monkeypatch.setattr(streams, "DECODE_SILENT_S", 0.05)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main():
        decode, prefill = _Pool2(), _Pool2()
        client = DecodeClient(decode, tok, fallback=prefill)
        asked = []

        async def alive():
            asked.append(time.monotonic())
            return len(asked) < 3  # the replica that answered is gone by the third question
        client._decode_alive = alive
        stream = RequestStream("m", 3, params, None)
        stream.prompt_token_ids, stream.token_ids = (5, 6, 7), [8, 9]  # moved, with 2 tokens
        stream.deadline = time.monotonic() + 30
        client._submit(stream)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if prefill.calls:
                break
        assert len(asked) >= 3 and len(prefill.calls) == 1
        assert list(prefill.calls[0][0].prompt_token_ids) == [5, 6, 7, 8, 9]
        client.close(stream)
        await client.sink.close()

    asyncio.run(main())
