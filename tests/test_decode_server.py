"""The decode and prefill roles as they ship (``DecodeServer``, ``PrefillServer``), driven in one
process without Ray: the `local` transport, a token sink standing in for the ingress, and a
stand-in for the prefill deployment's handle. Offline tokens colocated and disaggregated; a
prefill replica that refuses or is gone is replaced by a local prefill at once; a cancelled
request stops and gives back every block and lease, wherever it was."""

import asyncio
import logging
import random

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from contracts import GenerateRequest, TokenSink
from contracts.messages import TIMELINE
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer.backends.local import LocalFabric
from prefill_worker.server import PrefillServer
from tests.models import random_prompts

CONFIG = EngineConfig(model="tiny", num_blocks=256, max_num_seqs=8, show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts([5, 40], vocab=512, seed=71)


class PrefillHandle:
    """Stands in for the prefill deployment's handle: ``.prefill.remote(req)`` runs the server
    (or raises ``fail``; ``hang`` never answers)."""

    def __init__(self, server=None, fail: Exception | None = None, hang: bool = False):
        self.prefill = self
        self.server, self.fail, self.hang = server, fail, hang
        self.calls = 0

    def remote(self, req):
        self.calls += 1

        async def call():
            if self.hang:
                await asyncio.Event().wait()
            if self.fail is not None:
                raise self.fail
            return await self.server.prefill(req)
        return asyncio.ensure_future(call())


@pytest.fixture(scope="module")
def offline():
    llm = LLM("tiny")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
def roles():
    """A prefill and a decode server sharing an in-process fabric; shut down afterwards."""
    made = []

    def make(handle_kw=None, disaggregated=True):
        fabric = LocalFabric()
        prefill = PrefillServer(CONFIG, "local", fabric=fabric) if disaggregated else None
        handle = PrefillHandle(prefill, **(handle_kw or {})) if disaggregated else None
        decode = DecodeServer(CONFIG, "local", handle, 2.0, fabric=fabric)
        made.extend(s for s in (prefill, decode) if s is not None)
        return prefill, handle, decode

    yield make
    for server in made:
        server.close()


async def _generate(decode, sink, prompt, rid, params=GREEDY):
    tokens, done = [], asyncio.Event()

    def on_delta(delta, _at):
        tokens.extend(delta.token_ids)
        if delta.finished:
            done.set()

    sink.register(rid, on_delta)
    result = await decode.generate(GenerateRequest(tuple(prompt), params, rid, await sink.start()))
    await asyncio.wait_for(done.wait(), 10)
    return tokens, result


def _idle(server) -> bool:
    return server.aengine.engine.pool.num_used_blocks == 0 and \
        not server.aengine.engine.has_unfinished_requests() and \
        (server.endpoint is None or server.endpoint.held_blocks == 0)


async def _until_idle(*servers, timeout=10.0):
    end = asyncio.get_running_loop().time() + timeout
    while not all(_idle(s) for s in servers):
        assert asyncio.get_running_loop().time() < end, "not back to idle"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_offline_tokens_and_idle_afterwards(roles, offline, disaggregated, caplog):
    caplog.set_level(logging.INFO, logger=TIMELINE.name)
    prefill, handle, decode = roles(disaggregated=disaggregated)

    async def main():
        sink = TokenSink()
        for i, prompt in enumerate(PROMPTS):
            tokens, result = await _generate(decode, sink, prompt, f"r{i}")
            assert tokens == offline[i] and result.num_output_tokens == len(tokens)
            assert result.finish_reason == "length"
            assert (result.transfer is not None) == disaggregated
            if disaggregated:
                assert result.transfer.blocks_sent > 0 and result.timing.prefill_called > 0
        await _until_idle(*(s for s in (prefill, decode) if s is not None))
        await sink.close()

    asyncio.run(main())
    # One timeline line per request and role, in the order of its milestones.
    lines = [r.getMessage() for r in caplog.records if r.name == TIMELINE.name]
    decode_lines = [m for m in lines if m.startswith("request r1 decode:")]
    assert len(decode_lines) == 1
    want = ["received", "prefill_called", "prefill_returned", "queued", "first_token",
            "finished"] if disaggregated else ["received", "queued", "first_token", "finished"]
    assert [w for w in decode_lines[0].split("; ")[1].split() if not w.startswith("+")] == want
    assert "length, 12 tokens" in decode_lines[0]
    assert ("prefilled remotely" in decode_lines[0]) == disaggregated
    assert any(m.startswith("request r1 prefill: push done") for m in lines) == disaggregated


@pytest.mark.parametrize("failure", [BackPressureError(1, 1), ActorDiedError()],
                         ids=["refused", "replica-gone"])
def test_unavailable_prefill_falls_back_to_a_local_prefill(roles, offline, failure):
    _, handle, decode = roles({"fail": failure})

    async def main():
        sink = TokenSink()
        tokens, result = await _generate(decode, sink, PROMPTS[1], "r")
        assert handle.calls == 1 and result.transfer is None  # asked once, then prefilled here
        assert tokens == offline[1]
        await _until_idle(decode)
        await sink.close()

    asyncio.run(main())


def test_a_prefill_that_never_answers_is_replaced_at_the_deadline(roles, offline):
    """A frozen prefill replica: the KV lease fails at its deadline (2 s here) and the decode
    replica prefills the request itself; nothing waits longer, nothing leaks."""
    _, handle, decode = roles({"hang": True})

    async def main():
        sink = TokenSink()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tokens, result = await _generate(decode, sink, PROMPTS[1], "r")
        assert tokens == offline[1] and result.transfer is None and handle.calls == 1
        assert 2.0 <= loop.time() - t0 < 8.0
        await _until_idle(decode)
        await sink.close()

    asyncio.run(main())


def test_a_failing_transfer_is_an_error_not_a_fallback(roles):
    _, _, decode = roles({"fail": RuntimeError("push broke")})

    async def main():
        sink = TokenSink()
        with pytest.raises(RuntimeError, match="push broke"):
            await _generate(decode, sink, PROMPTS[0], "r")
        await _until_idle(decode)
        await sink.close()

    asyncio.run(main())


@pytest.mark.parametrize("where", ["prefill call", "decoding"])
def test_cancelled_request_stops_and_gives_everything_back(roles, where):
    prefill, handle, decode = roles({"hang": where == "prefill call"})
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        sink = TokenSink()
        got = []
        sink.register("r", lambda d, _at: got.extend(d.token_ids))
        task = asyncio.ensure_future(decode.generate(
            GenerateRequest(tuple(PROMPTS[1]), params, "r", await sink.start())))
        while (handle.calls == 0) if where == "prefill call" else len(got) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_idle(prefill, decode)
        made = decode.aengine.engine.stats.output_tokens
        await asyncio.sleep(0.3)
        assert decode.aengine.engine.stats.output_tokens == made  # nothing runs on
        assert len(got) < 2000
        await sink.close()

    asyncio.run(main())


def test_cancellation_at_random_points_leaves_nothing_behind(roles):
    """Requests cancelled at random moments (reserving, leased, prefilling, pushing, landing,
    admitting, decoding): both roles end idle and make no more tokens."""
    prefill, _, decode = roles()
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    rng = random.Random(5)
    prompts = random_prompts([rng.randint(3, 90) for _ in range(30)], vocab=512, seed=72)

    async def one(i, address):
        task = asyncio.ensure_future(decode.generate(
            GenerateRequest(tuple(prompts[i]), params, f"r{i}", address)))
        await asyncio.sleep(rng.uniform(0, 0.08))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def main():
        sink = TokenSink()
        address = await sink.start()
        await asyncio.gather(*[one(i, address) for i in range(len(prompts))])
        await _until_idle(prefill, decode, timeout=20)
        made = decode.aengine.engine.stats.output_tokens
        await asyncio.sleep(0.3)
        assert decode.aengine.engine.stats.output_tokens == made
        assert decode.publisher.num_routes == 0
        await sink.close()

    asyncio.run(main())


def test_closing_a_replica_releases_its_pending_leases(roles):
    """At shutdown a decode replica waiting for a prefill's KV fails that lease at once: its
    blocks come back without waiting for the deadline."""
    _, handle, decode = roles({"hang": True})

    async def main():
        sink = TokenSink()
        task = asyncio.ensure_future(decode.generate(
            GenerateRequest(tuple(PROMPTS[1]), GREEDY, "r", await sink.start())))
        while handle.calls == 0:
            await asyncio.sleep(0.01)
        assert decode.held_blocks > 0
        decode.close()
        assert decode.held_blocks == 0 and decode.aengine.engine.pool.num_used_blocks == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sink.close()

    asyncio.run(main())
