"""The decode and prefill roles as they ship (``DecodeServer``, ``PrefillServer``), driven in one
process without Ray: the `local` transport, a token sink standing in for the ingress, and a
stand-in for the prefill deployment's handle. Offline tokens colocated and disaggregated; a
prefill replica that refuses or is gone is replaced by a local prefill at once; a cancelled
request stops and gives back every block and lease, wherever it was."""

import asyncio
import logging
import random
import time

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from contracts import GenerateRequest, TokenSink
from contracts.messages import TIMELINE
from decode_worker.placement import ALWAYS, DisaggregationConfig
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer import (LayoutMismatchError, PushNotStarted, TransferState,
                        TransportUnavailableError)
from kvtransfer.backends.local import LocalFabric
from prefill_worker.server import PrefillServer
from tests.models import random_prompts
from tests.roles import (GREEDY, ROLE_CONFIG, PrefillHandle, generate, offline_tokens,
                         until_idle)

CONFIG = ROLE_CONFIG
PROMPTS = random_prompts([5, 40], vocab=512, seed=71)


@pytest.fixture(scope="module")
def offline():
    return offline_tokens(PROMPTS)


@pytest.fixture
def roles():
    """A prefill and a decode server sharing an in-process fabric; shut down afterwards."""
    made = []

    def make(handle_kw=None, disaggregated=True, timeout_s=2.0):
        fabric = LocalFabric()
        prefill = PrefillServer(CONFIG, "local", fabric=fabric) if disaggregated else None
        handle = PrefillHandle(prefill, **(handle_kw or {})) if disaggregated else None
        decode = DecodeServer(CONFIG, "local", handle, timeout_s, fabric=fabric,
                              disaggregation=ALWAYS)
        made.extend(s for s in (prefill, decode) if s is not None)
        return prefill, handle, decode

    yield make
    for server in made:
        server.close()


async def _until_prefill_called(decode, handle, sink) -> asyncio.Task:
    """A request of PROMPTS[1] running on ``decode``, once it has called its prefill replica."""
    task = asyncio.ensure_future(decode.generate(
        GenerateRequest(tuple(PROMPTS[1]), GREEDY, "r", await sink.start())))
    while handle.calls == 0:
        await asyncio.sleep(0.01)
    return task


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_offline_tokens_and_idle_afterwards(roles, offline, disaggregated, caplog):
    caplog.set_level(logging.INFO, logger=TIMELINE.name)
    prefill, handle, decode = roles(disaggregated=disaggregated)

    async def main():
        sink = TokenSink()
        for i, prompt in enumerate(PROMPTS):
            tokens, result = await generate(decode, sink, prompt, f"r{i}", GREEDY)
            assert tokens == offline[i] and result.num_output_tokens == len(tokens)
            assert result.finish_reason == "length"
            assert (result.transfer is not None) == disaggregated
            if disaggregated:
                assert result.transfer.blocks_sent > 0 and result.timing.prefill_called > 0
        await until_idle(*(s for s in (prefill, decode) if s is not None))
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


@pytest.mark.parametrize("failure", [
    BackPressureError(1, 1), ActorDiedError(),
    TransportUnavailableError("transfer backend 'cuda_ipc' needs both engines on one node"),
    PushNotStarted("push of r failed: deadline passed before the push started")],
    ids=["refused", "replica-gone", "no-transport-for-the-pair", "push-past-its-deadline"])
def test_unavailable_prefill_falls_back_to_a_local_prefill(roles, offline, failure):
    _, handle, decode = roles({"fail": failure})

    async def main():
        sink = TokenSink()
        tokens, result = await generate(decode, sink, PROMPTS[1], "r", GREEDY)
        assert handle.calls == 1 and result.transfer is None  # asked once, then prefilled here
        assert tokens == offline[1]
        await until_idle(decode)
        await sink.close()

    asyncio.run(main())


class DiesAfterPushing(PrefillHandle):
    """A prefill replica that pushes the KV (it lands) and dies before its answer comes."""

    def remote(self, req):
        self.calls += 1

        async def call():
            await self.server.prefill(req)
            await asyncio.sleep(0.2)  # the decode replica's poll has seen the KV land
            raise ActorDiedError()
        return asyncio.ensure_future(call())


def _run_placed(scenario, disaggregation, handle_kw=None, handle_cls=PrefillHandle,
                timeout_s: float = 5.0, decode_config: EngineConfig = CONFIG):
    """``scenario(prefill, handle, decode, sink)`` on a prefill and a decode server whose
    decode replica places requests by ``disaggregation`` (``decode_worker.placement``), the
    prefill deployment's handle a ``handle_cls``; both idle afterwards, then closed."""
    fabric = LocalFabric()
    prefill = PrefillServer(CONFIG, "local", fabric=fabric)
    handle = handle_cls(prefill, **(handle_kw or {}))
    decode = DecodeServer(decode_config, "local", handle, timeout_s, fabric=fabric,
                          disaggregation=disaggregation)

    async def main():
        sink = TokenSink()
        await scenario(prefill, handle, decode, sink)
        await until_idle(prefill, decode)
        await sink.close()

    try:
        asyncio.run(main())
    finally:
        prefill.close()
        decode.close()


def test_a_prefill_replica_that_dies_after_its_kv_landed_is_replaced_at_once(offline):
    """The KV is there but the first token never comes: the lease is released at once and the
    request prefilled here, with the offline tokens; nothing stays reserved or leased."""
    async def main(prefill, handle, decode, sink):
        tokens, result = await asyncio.wait_for(
            generate(decode, sink, PROMPTS[1], "r", GREEDY), 10)
        assert handle.calls == 1 and result.transfer is None and tokens == offline[1]

    _run_placed(main, ALWAYS, handle_cls=DiesAfterPushing, timeout_s=30.0)


def test_a_prefill_that_never_answers_is_replaced_at_the_deadline(roles, offline):
    """A frozen prefill replica: the KV lease fails at its deadline (2 s here) and the decode
    replica prefills the request itself; nothing waits longer, nothing leaks."""
    _, handle, decode = roles({"hang": True})

    async def main():
        sink = TokenSink()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tokens, result = await generate(decode, sink, PROMPTS[1], "r", GREEDY)
        assert tokens == offline[1] and result.transfer is None and handle.calls == 1
        assert 2.0 <= loop.time() - t0 < 8.0
        await until_idle(decode)
        await sink.close()

    asyncio.run(main())


def test_a_silent_call_to_a_prefill_pool_that_is_gone_is_given_up_at_once(roles, offline,
                                                                           monkeypatch):
    """A call that has not answered for SILENT_CALL_S while the prefill pool has, for certain,
    no live replica (its actors are gone: Serve would fail the call only seconds later) is
    given up then, not at its lease's deadline: the request is prefilled here with the same
    tokens, and the next one without calling (prefill_down); nothing leaks. While the pool is
    not known to be gone (busy, starting), the call is waited for."""
    import decode_worker.server as server

    gone = {"now": False}

    async def role_gone(handle, timeout_s):
        return gone["now"]

    monkeypatch.setattr(server, "role_gone", role_gone)
    monkeypatch.setattr(server, "SILENT_CALL_S", 0.2)
    _, handle, decode = roles({"hang": True}, timeout_s=30.0)

    async def main():
        sink = TokenSink()
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(generate(decode, sink, PROMPTS[1], "r", GREEDY))
        await asyncio.sleep(0.7)  # silent, but the pool is not known to be gone: waited for
        assert not first.done() and handle.calls == 1
        gone["now"] = True
        t0 = loop.time()
        tokens, result = await asyncio.wait_for(first, 5)
        assert loop.time() - t0 < 1.0
        assert tokens == offline[1] and result.transfer is None
        assert result.prefilled_why == "prefill_unavailable" and decode.placer.prefill_down
        tokens, result = await generate(decode, sink, PROMPTS[0], "s", GREEDY)
        assert tokens == offline[0] and result.prefilled_why == "prefill_down"
        assert handle.calls == 1
        await until_idle(decode)
        await sink.close()

    asyncio.run(main())


def test_a_kv_layout_mismatch_is_refused_loudly_not_prefilled_here(caplog):
    """Roles that disagree on the KV layout (a block size here) are misconfigured: the prefill
    replica refuses before computing anything, and the decode replica fails the request (an
    error in its log) instead of prefilling it, and every later one, itself without a word."""
    fabric = LocalFabric()
    prefill = PrefillServer(CONFIG.model_copy(update={"block_size": 32}), "local", fabric=fabric)
    decode = DecodeServer(CONFIG, "local", PrefillHandle(prefill), 2.0, fabric=fabric, disaggregation=ALWAYS)

    async def main():
        sink = TokenSink()
        with pytest.raises(LayoutMismatchError, match="block_size"):
            await generate(decode, sink, PROMPTS[1], "r", GREEDY)
        assert prefill.aengine.engine.stats.prompt_tokens == 0  # refused before any work
        assert decode.aengine.engine.stats.prompt_tokens == len(PROMPTS[1])  # reserved only
        await until_idle(prefill, decode)
        await sink.close()

    try:
        with caplog.at_level(logging.ERROR, logger="ray.serve"):
            asyncio.run(main())
        assert any("configuration error" in r.getMessage() for r in caplog.records)
    finally:
        prefill.close()
        decode.close()


def test_a_failing_transfer_is_an_error_not_a_fallback(roles):
    _, _, decode = roles({"fail": RuntimeError("push broke")})

    async def main():
        sink = TokenSink()
        with pytest.raises(RuntimeError, match="push broke"):
            await generate(decode, sink, PROMPTS[0], "r", GREEDY)
        await until_idle(decode)
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
        await until_idle(prefill, decode)
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
        await until_idle(prefill, decode, timeout=20)
        made = decode.aengine.engine.stats.output_tokens
        await asyncio.sleep(0.3)
        assert decode.aengine.engine.stats.output_tokens == made
        assert decode.publisher.num_routes == 0
        await sink.close()

    asyncio.run(main())


def _slow_writes(endpoint, seconds: float) -> None:
    """The local transport as a one-sided one whose writes run ``seconds`` after they start:
    in flight until then, then copied and landed (a CUDA copy queued behind other work)."""
    backend = endpoint.backends["local"]
    start_write, pending = backend.start_write, {}

    def slow_start(peer, transfer_id, src, dst, heads=None):
        pending[transfer_id] = (time.time() + seconds, (peer, transfer_id, src, dst, heads))
        return transfer_id

    def check(transfer_id):
        ends_at, args = pending[transfer_id]
        if time.time() < ends_at:
            return TransferState.IN_FLIGHT
        return start_write(*args)

    backend.start_write, backend.check_write = slow_start, check


def test_a_write_in_flight_at_the_deadline_never_lands_in_blocks_in_use(roles, offline):
    """The sender's write is still in flight at the hand-over's deadline (1 s here; it runs to
    1.6 s): the sender keeps it, and its source blocks, until it has ended; the decode replica
    gives the lease up at its deadline and prefills the request itself (the offline tokens, no
    later than before), but keeps the leased blocks out of use (fenced) until the prefill call
    ends, so the late write lands in blocks nobody was given. Then both roles are idle."""
    prefill, _, decode = roles(timeout_s=1.0)
    _slow_writes(prefill.endpoint, 1.6)

    async def main():
        sink = TokenSink()
        t0 = time.monotonic()
        tokens, result = await generate(decode, sink, PROMPTS[1], "r", GREEDY)
        assert tokens == offline[1] and result.transfer is None
        assert time.monotonic() - t0 < 1.6  # prefilled here at the deadline, not after
        engine = decode.aengine.engine
        fenced = [k for k in engine.scheduler.held if k.startswith("fenced/r/")]
        assert fenced and engine.pool.num_used_blocks == len(engine.scheduler.held[fenced[0]])
        assert prefill.endpoint.held_blocks > 0  # the source blocks, read by the write
        await until_idle(prefill, decode)
        assert time.monotonic() - t0 >= 1.6  # not before the write ended
        await sink.close()

    asyncio.run(main())


def test_closing_a_replica_releases_its_pending_leases(roles):
    """At shutdown a decode replica waiting for a prefill's KV fails that lease at once: its
    blocks come back without waiting for the deadline."""
    _, handle, decode = roles({"hang": True})

    async def main():
        sink = TokenSink()
        task = await _until_prefill_called(decode, handle, sink)
        assert decode.held_blocks > 0
        decode.close()
        assert decode.held_blocks == 0 and decode.aengine.engine.pool.num_used_blocks == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sink.close()

    asyncio.run(main())


async def _abandoned_during_the_push(decode, handle, sink) -> int:
    """A request of PROMPTS[1] ("r") cancelled once it has called its prefill replica; the
    blocks its hand-over holds then."""
    task = await _until_prefill_called(decode, handle, sink)
    fenced = decode.held_blocks
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return fenced


def test_a_request_abandoned_during_the_push_keeps_its_blocks_until_the_prefill_answers(roles):
    """The client goes away while a prefill replica may still write into the request's blocks
    (a one-sided transport): the blocks stay fenced until that replica has answered (its push is
    over), then everything is released; no block is handed to another request in between."""
    prefill, handle, decode = roles({"delay": 0.5})

    async def main():
        sink = TokenSink()
        fenced = await _abandoned_during_the_push(decode, handle, sink)
        await asyncio.sleep(0.1)
        assert fenced > 0 and decode.held_blocks == fenced  # still fenced: the push may come
        assert decode.aengine.engine.pool.num_used_blocks >= fenced
        await until_idle(prefill, decode)  # the prefill answered: released
        assert handle.answered == 1
        await sink.close()

    asyncio.run(main())


@pytest.mark.parametrize("later", ["runs", "is cancelled"])
def test_a_later_run_of_an_id_waits_for_the_blocks_its_earlier_run_left_fenced(roles, offline,
                                                                                later):
    """An aborted run (an early start dropped because its call came late) whose prefill call
    still writes into its blocks, then the late call under the same id: that run starts once the
    fenced blocks are released (the prefill call has answered), gives the offline tokens, and
    the fenced blocks are never handed back while the push may still write them. Cancelled
    while it waits (its client went away), it took nothing, so its abort leaves the earlier
    run's hand-over alone (before, that abort released its blocks under the push)."""
    prefill, handle, decode = roles({"delay": 0.5})

    async def main():
        sink = TokenSink()
        fenced = await _abandoned_during_the_push(decode, handle, sink)
        late = asyncio.ensure_future(generate(decode, sink, PROMPTS[1], "r", GREEDY))
        await asyncio.sleep(0.2)
        if later == "is cancelled":
            late.cancel()
            await asyncio.gather(late, return_exceptions=True)
            await decode.aengine.call(lambda e: None)  # (any abort it queued has run)
        assert fenced > 0 and decode.held_blocks == fenced  # still the first run's, fenced
        assert handle.calls == 1 and handle.answered == 0
        if later == "runs":
            assert not late.done()  # the late run waits for them
            tokens, result = await asyncio.wait_for(late, 30)
            assert tokens == offline[1] and result.transfer is not None
            assert handle.calls == 2
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


@pytest.mark.parametrize("first", ["abandoned", "prefilled here"])
def test_a_later_run_of_an_id_waits_for_a_call_that_outlived_its_lease(roles, offline, first):
    """A run's lease reaches its deadline (1 s) while its write is still in flight (to 1.6 s):
    its blocks are set aside, and a later run of the same id (an early start's call) waits for
    that prefill call's end before its own hand-over (its late answer, and the transport's word,
    name the same id's transfer), whether the first run was abandoned during the push or went
    on to be prefilled here; then it runs with the offline tokens, and the set-aside blocks
    come back once the write has ended."""
    prefill, handle, decode = roles(timeout_s=1.0)
    _slow_writes(prefill.endpoint, 1.6)

    async def main():
        sink = TokenSink()
        t0 = time.monotonic()
        if first == "abandoned":
            await _abandoned_during_the_push(decode, handle, sink)
        else:
            tokens, result = await generate(decode, sink, PROMPTS[1], "r", GREEDY)
            assert tokens == offline[1] and result.transfer is None
        late = asyncio.ensure_future(generate(decode, sink, PROMPTS[1], "r", GREEDY))
        while time.monotonic() < t0 + 1.4:  # past the first lease's end, not its write's
            await asyncio.sleep(0.05)
        assert any(k.startswith("fenced/r/") for k in decode.aengine.engine.scheduler.held)
        assert handle.calls == 1 and not late.done()
        tokens, _ = await asyncio.wait_for(late, 30)
        assert tokens == offline[1] and handle.calls == 2
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


def test_an_answer_that_comes_as_the_lease_is_fenced_prefills_here(roles, offline):
    """The sender's write ended just past its deadline (DONE), and its answer came in the same
    turn as the lease's end (fenced): the request is prefilled here, not failed, and the fence
    ends with the call."""
    from types import SimpleNamespace

    from contracts.messages import DecodeTiming, PrefillResult
    from kvtransfer import TransferStats

    _, _, decode = roles()

    async def main():
        loop = asyncio.get_running_loop()
        outcome, call, answer = loop.create_future(), loop.create_future(), loop.create_future()
        h = SimpleNamespace(outcome=outcome, fence="fenced/x/0", reason="deadline passed")
        outcome.set_result(h)
        result = PrefillResult(request_id="x", first_token=7, first_logprob=None,
                               num_prompt_tokens=4, num_cached_tokens=0,
                               stats=TransferStats(backend="local"), prefill_seconds=0.01)
        call.set_result(result)
        answer.set_result(result.to_wire())
        assert await decode._handed_over("x", h, call, answer, DecodeTiming()) is None
        await asyncio.sleep(0)  # the fence's end: at once, the call has ended

    asyncio.run(main())


def test_abort_anywhere_is_harmless_twice_and_ids_stay_apart(roles, offline):
    """``abort`` of a reserved hand-over, of an unknown id, and twice; a reservation under an id
    still in use is refused rather than mixed up with the first."""
    prefill, _, decode = roles()

    async def main():
        dest = await decode.reserve(PROMPTS[1], GREEDY, "x")
        assert decode.held_blocks == len(dest.block_ids) > 0
        with pytest.raises(ValueError, match="already in use"):
            await decode.reserve(PROMPTS[1], GREEDY, "x")
        await decode.aengine.call(lambda e: None)  # (any abort it queued has run)
        assert decode.held_blocks == len(dest.block_ids)  # the refusal left the first alone
        decode.abort("x")
        decode.abort("x")
        decode.abort("never-seen")
        await until_idle(decode)
        sink = TokenSink()
        tokens, _ = await generate(decode, sink, PROMPTS[1], "x", GREEDY)  # the id is free again
        assert tokens == offline[1]
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


def test_a_push_whose_deadline_passed_before_it_started_says_so(roles):
    """A prefill call that reaches its replica after the hand-over's deadline (queued while the
    replica restarted) computes nothing, writes nothing and raises ``PushNotStarted``, which the
    decode replica answers with a local prefill (above), not an error."""
    from contracts.messages import PrefillRequest

    prefill, _, decode = roles()

    async def main():
        dest = await decode.reserve(PROMPTS[1], GREEDY, "late", timeout_s=0.0)
        with pytest.raises(PushNotStarted, match="deadline passed before the push started"):
            await prefill.prefill(PrefillRequest(tuple(PROMPTS[1]), GREEDY, dest,
                                                 decode.endpoint.info()))
        assert prefill.aengine.engine.stats.prompt_tokens == 0  # not computed for nobody
        decode.abort("late")
        await until_idle(decode, prefill)

    asyncio.run(main())


@pytest.mark.parametrize("disaggregated", [False, True])
def test_bad_input_only_a_replica_can_check_is_refused_on_the_channel(roles, disaggregated):
    """A grammar that does not compile, or a prompt the model cannot run: the refusal comes
    as the request's result on the token channel (the ingress's 400), nothing raises, nothing
    is held."""
    from engine.structured import StructuredOutput

    prefill, _, decode = roles(disaggregated=disaggregated)
    bad_grammar = GREEDY.model_copy(update={"structured_output": StructuredOutput(
        kind="regex", spec="(unclosed")})
    too_long = list(range(1, 200)) * 25  # beyond the context

    async def main():
        sink = TokenSink()
        for i, (prompt, params, says) in enumerate([
                (PROMPTS[0], bad_grammar, "guided_regex"),
                (too_long, GREEDY, "leave no room")]):
            tokens, result = await generate(decode, sink, prompt, f"bad{i}", params)
            assert tokens == [] and result.error is not None and says in result.error
        await until_idle(*(s for s in (prefill, decode) if s is not None))
        await sink.close()

    asyncio.run(main())


def test_a_short_prompt_is_prefilled_where_it_decodes_a_long_one_handed_over(offline):
    """auto: a prompt whose uncached part is at most max_local_prefill_length is prefilled on
    the decode replica, a longer one by the (idle) prefill replica; the same long prompt again
    finds its blocks in the decode replica's own prefix cache and stays there too. Same tokens
    either way; where and why is in each result."""
    async def main(prefill, handle, decode, sink):
        got = [await generate(decode, sink, p, f"r{i}", GREEDY) for i, p in
               enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[1]])]
        assert [(r.prefilled_where, r.prefilled_why) for _, r in got] == [
            ("local", "short"), ("remote", "long"), ("local", "short")]
        assert [t for t, _ in got] == [offline[0], offline[1], offline[1]]
        assert handle.calls == 1 and got[1][1].transfer is not None
        assert got[2][1].num_cached_tokens == 32  # the landed blocks, cached where it decodes

    _run_placed(main, DisaggregationConfig(max_local_prefill_length=16))


def test_a_saturated_prefill_pool_sends_long_prompts_local(offline):
    """auto: once both rates are measured (a short prompt here, a long one over there, slow),
    a long prompt whose first token would come later from the prefill pool, busy with another
    of this replica's prompts, than from here is prefilled here ('saturated'), with the same
    tokens; once the pool has nothing of ours, a long prompt is handed over again."""
    async def main(prefill, handle, decode, sink):
        _, short = await generate(decode, sink, PROMPTS[0], "a", GREEDY)
        _, handed = await generate(decode, sink, random_prompts([48], 512, 7)[0], "b", GREEDY)
        busy_call = asyncio.ensure_future(
            generate(decode, sink, random_prompts([48], 512, 8)[0], "b2", GREEDY))
        while not decode.placer.outstanding:  # b2 is at the prefill replica
            await asyncio.sleep(0.01)
        tokens, busy = await generate(decode, sink, PROMPTS[1], "c", GREEDY)
        _, second = await busy_call
        _, idle = await generate(decode, sink, random_prompts([48], 512, 9)[0], "d", GREEDY)
        assert [(r.prefilled_where, r.prefilled_why) for r in (short, handed, second, busy,
                                                                 idle)] == [
            ("local", "short"), ("remote", "long"), ("remote", "long"), ("local", "saturated"),
            ("remote", "long")]
        assert tokens == offline[1] and handle.calls == 3
        assert decode.placer.outstanding == 0

    _run_placed(main, DisaggregationConfig(max_local_prefill_length=16), {"delay": 0.5})


def test_an_inter_token_target_hands_over_a_short_prompt_once_steps_are_measured(offline):
    """auto with ``itl_target_ms``: before this replica has measured a step, a short prompt is
    prefilled here; once it has, a short prompt whose step would exceed the (here impossibly
    small) target is handed over ('itl'), with the same tokens."""
    async def main(prefill, handle, decode, sink):
        got = [await generate(decode, sink, p, f"r{i}", GREEDY) for i, p in
               enumerate(PROMPTS)]
        assert [(r.prefilled_where, r.prefilled_why) for _, r in got] == [
            ("local", "short"), ("remote", "itl")]
        assert [t for t, _ in got] == offline[:2] and handle.calls == 1

    _run_placed(main, DisaggregationConfig(itl_target_ms=1e-6))


@pytest.mark.parametrize("mode,where", [("always", "remote"), ("never", "local")])
def test_always_and_never_place_every_prompt_alike(offline, mode, where):
    async def main(prefill, handle, decode, sink):
        for i, prompt in enumerate(PROMPTS):
            tokens, result = await generate(decode, sink, prompt, f"r{i}", GREEDY)
            assert (result.prefilled_where, result.prefilled_why) == (where, mode)
            assert tokens == offline[i]
        assert handle.calls == (len(PROMPTS) if mode == "always" else 0)

    _run_placed(main, DisaggregationConfig(mode=mode))


def test_a_dead_prefill_replica_is_not_called_again_until_one_answers(offline):
    """A prefill call that finds its replica dead: that request and every later one are
    prefilled here at once ('prefill_down', no call to the dead replica), until a prefill
    replica answers the probe again; then prompts are handed over again."""
    async def main(prefill, handle, decode, sink):
        _, first = await generate(decode, sink, PROMPTS[1], "a", GREEDY)
        tokens, second = await generate(decode, sink, PROMPTS[1], "b", GREEDY)
        assert (first.prefilled_why, second.prefilled_why) == (
            "prefill_unavailable", "prefill_down")
        assert handle.calls == 1 and tokens == offline[1]
        handle.fail = None  # a prefill replica is back
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while decode.placer.prefill_down:
            assert loop.time() < end, "the probe never saw the prefill replica back"
            await asyncio.sleep(0.05)
        tokens, third = await generate(decode, sink, PROMPTS[0], "c", GREEDY)
        assert (third.prefilled_where, third.prefilled_why) == ("remote", "always")
        assert tokens == offline[0] and handle.calls == 2

    _run_placed(main, ALWAYS, {"fail": ActorDiedError()})


ONE_SLOT = CONFIG.model_copy(update={"max_num_seqs": 1})  # a decode replica that fills fast


async def _slot_taken(decode, sink, max_tokens: int) -> asyncio.Task:
    """Request "a" (PROMPTS[0], greedy, ``max_tokens``) running on ``decode``, once it holds the
    decode replica's one sequence slot (``ONE_SLOT``): the next prompt finds no room."""
    running = asyncio.ensure_future(generate(decode, sink, PROMPTS[0], "a", SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    while not decode.aengine.engine.scheduler.running:
        await asyncio.sleep(0.005)
    return running


@pytest.mark.parametrize("early", [True, False], ids=["first-token-while-queued", "off"])
def test_no_room_here_the_first_token_comes_from_a_prefill_replica(offline, early):
    """A decode replica whose one sequence slot is taken queues a prompt it would hand over
    ('no_room'); with ``first_token_while_queued`` a prefill replica makes its first token,
    published while the running request still decodes, and the rest comes from here once the
    slot frees: the offline tokens, no KV moved, both replicas idle afterwards. Off, the first
    token waits for the slot."""

    async def main(prefill, handle, decode, sink):
        running = await _slot_taken(decode, sink, 150)
        tokens, queued = await generate(decode, sink, PROMPTS[1], "b", GREEDY)
        _, first = await running
        assert tokens == offline[1] and queued.num_output_tokens == len(tokens)
        assert (queued.prefilled_where, queued.prefilled_why) == ("local", "no_room")
        assert queued.transfer is None and handle.calls == 1  # only "a" was handed over
        assert handle.first_token_calls == int(early)
        assert queued.timing.first_token_by_prefill == early
        if early:  # out before "a" ended; the call's times are in the timing
            assert queued.timing.first_token < first.timing.finished
            assert 0 < queued.timing.prefill_called < queued.timing.prefill_returned
        else:
            assert queued.timing.first_token > first.timing.finished

    _run_placed(main, DisaggregationConfig(mode="always", first_token_while_queued=early),
                decode_config=ONE_SLOT)


def test_a_seeded_request_whose_first_token_came_from_elsewhere_draws_as_on_one_engine():
    """Seeded sampling draws each token with the noise of (seed, position), so a request whose
    first token the prefill replica drew, and whose rest this replica draws after computing the
    prompt, gets the tokens of one engine."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=7)
    want = LLM("tiny").generate([PROMPTS[1]], seeded)[0].token_ids

    async def main(prefill, handle, decode, sink):
        running = await _slot_taken(decode, sink, 150)
        tokens, queued = await generate(decode, sink, PROMPTS[1], "b", seeded)
        await running
        assert queued.timing.first_token_by_prefill and tokens == want

    _run_placed(main, ALWAYS, decode_config=ONE_SLOT)


@pytest.mark.parametrize("failure", [BackPressureError(1, 1), ActorDiedError()],
                         ids=["refused", "replica-died"])
def test_a_first_token_call_that_fails_leaves_the_prompt_to_the_decode_replica(offline, failure):
    """No room here and the first-token call fails (the prefill replica refuses it, its queue
    full, or has died): the request's first token comes from this replica once the slot frees,
    the offline tokens all the same; a dead replica also sends later prompts here until one
    answers again."""

    async def main(prefill, handle, decode, sink):
        running = await _slot_taken(decode, sink, 60)
        handle.fail = failure
        tokens, queued = await generate(decode, sink, PROMPTS[1], "b", GREEDY)
        _, first = await running
        assert tokens == offline[1] and handle.first_token_calls == 1
        assert not queued.timing.first_token_by_prefill
        assert queued.timing.first_token > first.timing.finished
        assert decode.placer.prefill_down == isinstance(failure, ActorDiedError)
        handle.fail = None

    _run_placed(main, ALWAYS, decode_config=ONE_SLOT)


def test_a_request_cancelled_while_its_first_token_is_made_elsewhere_leaves_nothing(offline):
    """No room here, the first-token call under way (a slow prefill replica): the cancelled
    request is gone from both replicas, and a late answer publishes nothing."""

    async def main(prefill, handle, decode, sink):
        running = await _slot_taken(decode, sink, 60)
        handle.delay = 0.3
        queued = asyncio.ensure_future(decode.generate(
            GenerateRequest(tuple(PROMPTS[1]), GREEDY, "b", await sink.start())))
        while handle.first_token_calls == 0:
            await asyncio.sleep(0.005)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert not decode._early
        await running
        await asyncio.sleep(0.4)  # past the slow answer, had it not been cancelled
        assert decode.aengine.engine.scheduler.find("b") is None

    _run_placed(main, ALWAYS, decode_config=ONE_SLOT)


# -- early starts: the request sent ahead of its Serve call over the token channel -----------
async def _early(decode, prompt, rid, params, sink=None):
    """An early-start sink connected to ``decode``'s publisher (as once a first call has run),
    the request sent over it as the ingress's replica choice sends it: ``(sink, request)``, once
    the replica has started it."""
    sink = sink or TokenSink(early_start=True)
    address = await sink.start()
    await decode.publisher.connect(address)
    while decode.publisher.publisher_id not in sink._publishers:
        await asyncio.sleep(0.01)
    req = GenerateRequest(tuple(prompt), params, rid, address)
    assert sink.submit(decode.publisher.publisher_id, req)
    while rid not in decode.early.unclaimed:
        await asyncio.sleep(0.005)
    return sink, req


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_an_early_start_claimed_by_its_call_gives_the_offline_tokens(roles, offline,
                                                                    disaggregated):
    """The engine starts the request before its call comes (handed over or prefilled here, as
    the call would have had it); nothing reaches the ingress until the call claims it; then
    the ingress gets the offline tokens and the result, once, and both roles end idle."""
    prefill, _, decode = roles(disaggregated=disaggregated)

    async def main():
        sink, _ = await _early(decode, PROMPTS[1], "r1", GREEDY)
        got = []
        sink.register("early", lambda d, _at: got.append(d))  # nothing for "r1" yet
        while not decode.aengine.engine.stats.output_tokens:  # it runs before its call
            await asyncio.sleep(0.01)
        assert sink.num_frames == 0
        tokens, result = await generate(decode, sink, PROMPTS[1], "r1", GREEDY)
        assert tokens == offline[1] and result.num_output_tokens == len(tokens)
        assert (result.transfer is not None) == disaggregated
        assert decode.early_starts == {"claimed": 1, "dropped": 0}
        await until_idle(*(s for s in (prefill, decode) if s is not None))
        await sink.close()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["never claimed", "withdrawn"])
def test_an_early_start_that_is_not_claimed_stops_and_sends_nothing(roles, monkeypatch, how):
    """Its call never came (or went to another replica, which the ingress says): cancelled like
    a call that went away, every block and lease back, no frame sent."""
    import contracts.streamed as streamed

    monkeypatch.setattr(streamed, "EARLY_CLAIM_S", 0.3)
    prefill, handle, decode = roles({"delay": 0.1})
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        sink, _ = await _early(decode, PROMPTS[1], "r", params)
        got = []
        sink.register("r", lambda d, _at: got.append(d), lambda rec: got.append(rec))
        if how == "withdrawn":
            while not handle.calls:
                await asyncio.sleep(0.01)
            sink.withdraw(decode.publisher.publisher_id, "r")
        while not decode.early_starts["dropped"]:
            await asyncio.sleep(0.01)
        await until_idle(prefill, decode)
        made = decode.aengine.engine.stats.output_tokens
        await asyncio.sleep(0.3)
        assert decode.aengine.engine.stats.output_tokens == made and got == []
        assert sink.num_frames == 0 and decode.publisher.num_routes == 0
        await sink.close()

    asyncio.run(main())


def test_a_claimed_early_start_times_its_claim(roles):
    """Its timing: received at the early start, claimed when its call came (while it ran)."""
    prefill, _, decode = roles()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        sink, req = await _early(decode, PROMPTS[0], "r", params)
        called = time.time()
        _, result = await generate(decode, sink, PROMPTS[0], "r", params)
        t = result.timing
        assert t.received < called <= t.claimed <= t.finished and result.num_output_tokens == 200
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


def test_a_claimed_early_start_whose_call_is_cancelled_stops(roles):
    prefill, _, decode = roles()
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        sink, req = await _early(decode, PROMPTS[0], "r", params)
        got = []
        sink.register("r", lambda d, _at: got.extend(d.token_ids))
        call = asyncio.ensure_future(decode.generate(req))
        while len(got) < 3:
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await until_idle(prefill, decode)
        assert len(got) < 2000 and decode.early_starts["claimed"] == 1
        await sink.close()

    asyncio.run(main())


@pytest.mark.parametrize("started", ["early", "by its call"])
def test_a_cancel_on_the_channel_stops_a_call_whose_serve_cancel_was_lost(roles, started):
    """Serve drops a call's cancel that comes while the call is being handed to its replica,
    the moment a claimed early start sends the tokens it held (a stop string in them ended the
    request at the ingress): the ingress's ``cancel`` on the token channel stops the request
    all the same, however it started, and frees its blocks; a cancel from another sink's
    connection does not."""
    prefill, _, decode = roles()
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        if started == "early":
            sink, req = await _early(decode, PROMPTS[0], "r", params)
        else:
            sink = TokenSink(early_start=True)
            req = GenerateRequest(tuple(PROMPTS[0]), params, "r", await sink.start())
        got = []
        sink.register("r", lambda d, _at: got.extend(d.token_ids))
        call = asyncio.ensure_future(decode.generate(req))  # its Serve cancel never comes
        while len(got) < 3:
            await asyncio.sleep(0.01)
        other = TokenSink(early_start=True)
        await decode.publisher.connect(await other.start())
        while len(other._publishers) < 1:
            await asyncio.sleep(0.01)
        other.cancel("r")  # not its request: ignored
        await asyncio.sleep(0.1)
        assert not call.done()
        sink.cancel("r")
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        await until_idle(prefill, decode)
        made = decode.aengine.engine.stats.output_tokens
        assert made < 2000 and not decode.early.running
        await sink.close()
        await other.close()

    asyncio.run(main())


@pytest.mark.parametrize("before", ["its early start", "its call"])
def test_a_request_cancelled_on_the_channel_before_it_came_never_runs(roles, before):
    """The ingress's cancel reached the replica before the request did (on every connection,
    as no frame of it had come yet): an early start that comes after it is not started, and
    an early start it withdrew, or the call that comes after it, ends at once without a
    token."""
    prefill, _, decode = roles()
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        sink = TokenSink(early_start=True)
        address = await sink.start()
        await decode.publisher.connect(address)
        while decode.publisher.publisher_id not in sink._publishers:
            await asyncio.sleep(0.01)
        req = GenerateRequest(tuple(PROMPTS[0]), params, "r", address)
        if before == "its early start":
            sink.cancel("r")
            await asyncio.sleep(0.05)
            assert sink.submit(decode.publisher.publisher_id, req)
            await asyncio.sleep(0.1)
            assert not decode.early.unclaimed
        else:
            await _early(decode, PROMPTS[0], "r", params, sink)
            sink.cancel("r")
            while decode.early.unclaimed:
                await asyncio.sleep(0.01)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(decode.generate(req), 10)
        await until_idle(prefill, decode)
        assert sink.num_frames == 0 and not decode.aengine.engine.has_unfinished_requests()
        await sink.close()

    asyncio.run(main())


def test_an_early_start_that_comes_after_its_call_is_ignored(roles, offline):
    """The call came first (the two travel apart): the request runs once, from its call."""
    _, _, decode = roles(disaggregated=False)

    async def main():
        sink = TokenSink(early_start=True)
        address = await sink.start()
        tokens, _ = await generate(decode, sink, PROMPTS[0], "r0", GREEDY)
        assert sink.submit(decode.publisher.publisher_id,
                           GenerateRequest(tuple(PROMPTS[0]), GREEDY, "r0", address))
        await asyncio.sleep(0.3)
        assert tokens == offline[0] and not decode.early.unclaimed
        assert not decode.aengine.engine.has_unfinished_requests()
        await sink.close()

    asyncio.run(main())


def test_bad_input_started_early_is_refused_once_its_call_claims_it(roles):
    """A prompt the model cannot run, started early: its refusal waits, held, for the call,
    then comes on the channel as the request's result; nothing raises, nothing is held."""
    prefill, _, decode = roles()
    too_long = list(range(1, 200)) * 25  # beyond the context

    async def main():
        sink, _ = await _early(decode, too_long, "bad", GREEDY)
        while not decode.early.unclaimed["bad"][0].done():  # refused before its call came
            await asyncio.sleep(0.01)
        assert sink.num_frames == 0
        tokens, result = await generate(decode, sink, too_long, "bad", GREEDY)
        assert tokens == [] and "leave no room" in result.error
        assert decode.early_starts == {"claimed": 1, "dropped": 0}
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


def test_an_early_start_calls_the_prefill_replica_under_a_serve_request_id_of_its_own(roles):
    """The connection's reader runs in the context of the call that dialled it; an early start
    must not make its prefill call under that call's Serve request id (concurrent calls under
    one id collide in Serve's bookkeeping): it runs in a context of its own."""
    from dataclasses import replace

    from ray.serve import context as serve_context

    prefill, handle, decode = roles()
    seen = []
    remote = handle.remote

    def recording(req):
        seen.append(serve_context._get_serve_request_context()._internal_request_id)
        return remote(req)

    handle.remote = recording

    async def main():
        dialler = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(replace(dialler,
                                                         _internal_request_id="dialler"))
        sink, _ = await _early(decode, PROMPTS[1], "r", GREEDY)  # dials in this context
        await generate(decode, sink, PROMPTS[1], "r", GREEDY)
        assert handle.calls == 1 and seen != ["dialler"]
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())
