"""A hand-over over the decode replica's own token sink, beside its Serve call: the prefill
replica's answer comes there as soon as its push has ended (ahead of the call's return), and
with ``router.early_start`` the decode replica sends the hand-over there ahead of the call (the
prefill replica computes the prompt at once; its push waits for the call's claim). Driven in
one process without Ray: the `local` transport, a stand-in for the prefill deployment's handle,
and a stand-in for the decode process's replica choice of the prefill pool."""

import asyncio
import time

import pytest

from contracts import TokenSink
from contracts.token_channel import early_sink, register_early_router
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import SamplingParams
from kvtransfer.backends.local import LocalFabric
from prefill_worker.server import PrefillServer
from tests.models import random_prompts
from tests.roles import (GREEDY, ROLE_CONFIG, PrefillHandle, generate, offline_tokens,
                         until_idle)

CONFIG = ROLE_CONFIG
PROMPTS = random_prompts([40, 24, 33], vocab=512, seed=83)


@pytest.fixture(scope="module")
def offline():
    return offline_tokens(PROMPTS)


@pytest.fixture
def roles():
    """Two prefill servers and a decode server handing over to the first (in one fabric)."""
    fabric = LocalFabric()
    first = PrefillServer(CONFIG, "local", fabric=fabric)
    other = PrefillServer(CONFIG, "local", fabric=fabric)
    handle = _handle(first)
    decode = DecodeServer(CONFIG, "local", handle, 5.0, fabric=fabric, disaggregation=ALWAYS)
    yield first, other, handle, decode
    for server in (first, other, decode):
        server.close()


def _handle(server: PrefillServer) -> PrefillHandle:
    """The stand-in for the prefill deployment's handle, named as Serve's is: the decode
    replica finds its process's replica choice of the pool by that name."""
    handle = PrefillHandle(server)
    handle.deployment_name = "PrefillServer"
    return handle


class EarlyRouter:
    """Stands in for the decode process's replica choice of the prefill pool: sends each
    hand-over ahead of its call to ``target`` (the replica it ranks first)."""

    def __init__(self, target: PrefillServer):
        self.target, self.sent, self.requests, self.withdrawn = target, [], {}, []

    def start_early(self, req) -> bool:
        sent = early_sink(req.reply_to).submit(self.target.publisher.publisher_id, req)
        self.sent.append(sent)
        self.requests[req.request_id] = req
        return sent

    def withdraw_early(self, request_id: str) -> None:
        self.withdrawn.append(request_id)
        early_sink(self.requests[request_id].reply_to).withdraw(
            self.target.publisher.publisher_id, request_id)


def _pushes(server: PrefillServer, monkeypatch) -> list:
    """The pushes ``server`` starts from now on (their arguments), each still made."""
    pushes, push = [], server.endpoint.push
    monkeypatch.setattr(server.endpoint, "push", lambda *a, **k: pushes.append(a) or
                        push(*a, **k))
    return pushes


async def _connected(decode, prefill, offline) -> None:
    """A first hand-over, which has ``prefill`` dial the decode replica's sink."""
    sink = TokenSink()
    tokens, _ = await generate(decode, sink, PROMPTS[0], "warm", GREEDY)
    assert tokens == offline[0]
    while prefill.publisher.publisher_id not in decode.sink._publishers:
        await asyncio.sleep(0.01)
    await sink.close()


def test_the_answer_on_the_sink_admits_before_the_calls_return(roles, offline):
    """Once the prefill replica is connected, the decode replica admits on the answer that
    comes on its sink: the request ends with the offline tokens, handed over, and both roles
    are idle while the prefill call has still not returned."""
    prefill, _, handle, decode = roles

    async def main():
        await _connected(decode, prefill, offline)
        handle.hold_return = asyncio.Event()
        sink = TokenSink()
        tokens, result = await asyncio.wait_for(
            generate(decode, sink, PROMPTS[1], "r1", GREEDY), 4.0)  # its lease lasts 5 s
        assert tokens == offline[1] and result.prefilled_where == "remote"
        assert result.transfer is not None and result.transfer.blocks_sent > 0
        assert result.timing.prefill.pushed <= result.timing.prefill_returned
        await until_idle(prefill, decode)
        assert handle.answered == 2 and not handle.hold_return.is_set()  # still held
        handle.hold_return.set()
        await sink.close()

    asyncio.run(main())


def test_a_hand_over_sent_ahead_of_its_call_is_claimed_by_it(roles, offline):
    """With the early start the prefill replica has the first token before the call arrives;
    the call claims the hand-over; the decode side gets the offline tokens."""
    prefill, _, handle, decode = roles
    router = EarlyRouter(prefill)
    register_early_router(handle.deployment_name, router)

    async def main():
        await _connected(decode, prefill, offline)  # sent early too, but not yet connected
        handle.delay = 0.3  # the call travels slowly
        sink = TokenSink()
        tokens, result = await generate(decode, sink, PROMPTS[2], "r2", GREEDY)
        assert tokens == offline[2] and result.prefilled_where == "remote"
        assert router.sent == [False, True]
        assert prefill.whole.early_starts == {"claimed": 1, "dropped": 0}
        assert result.timing.prefill.prefilled < handle.arrived[-1]  # computed before the call
        # ``always``: sent before the decode replica's reservation, so it named no blocks; the
        # push filled the ones the call named, and the hand-over was sent before they were
        assert router.requests["r2"].dest.block_ids == ()
        assert result.transfer is not None and result.transfer.blocks_sent > 0
        assert result.timing.prefill_called < result.timing.reserved
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["never claimed", "withdrawn"])
def test_an_early_hand_over_its_call_does_not_claim_never_pushes(roles, offline, monkeypatch,
                                                                 how):
    """The hand-over is sent ahead to one prefill replica, its call goes to another (which
    pushes): the first computes the prompt but never pushes, and once withdrawn (or when no
    call has come in time) gives its blocks back. The request has the offline tokens."""
    import contracts.streamed as streamed

    monkeypatch.setattr(streamed, "EARLY_CLAIM_S", 0.3)
    prefill, other, handle, decode = roles
    router = EarlyRouter(other)  # (the registry holds it weakly)
    register_early_router(handle.deployment_name, router)
    pushes = _pushes(other, monkeypatch)

    async def main():
        handle.server = other
        await _connected(decode, other, offline)  # a call there once: ``other`` dials the sink
        handle.server = prefill
        del pushes[:]
        sink = TokenSink()
        run = asyncio.ensure_future(generate(decode, sink, PROMPTS[1], "r1", GREEDY))
        while not other.whole.early.unclaimed:
            await asyncio.sleep(0.005)
        if how == "withdrawn":  # what the replica choice does when the call went elsewhere
            early_sink(decode.sink.address).withdraw(other.publisher.publisher_id, "r1")
        tokens, result = await run
        assert tokens == offline[1] and result.prefilled_where == "remote"
        while not other.whole.early_starts["dropped"]:
            await asyncio.sleep(0.01)
        await until_idle(prefill, other, decode)
        assert pushes == [] and other.whole.early_starts["claimed"] == 0
        await sink.close()

    asyncio.run(main())


def test_an_early_hand_over_whose_reservation_finds_no_room_is_withdrawn(roles, offline,
                                                                        monkeypatch):
    """Sent ahead of the reservation, which then finds no room: no call follows, so the
    hand-over is withdrawn at once and its prefill replica gives its blocks back unpushed; the
    request is prefilled on the decode replica (its first token by a prefill replica meanwhile)
    with the offline tokens."""
    prefill, _, handle, decode = roles
    router = EarlyRouter(prefill)
    register_early_router(handle.deployment_name, router)
    pushes = _pushes(prefill, monkeypatch)

    async def main():
        await _connected(decode, prefill, offline)
        del pushes[:]
        engine = decode.aengine.engine
        monkeypatch.setattr(engine, "reserve", lambda *a, **k: None)  # no room right now
        sink = TokenSink()
        tokens, result = await asyncio.wait_for(
            generate(decode, sink, PROMPTS[1], "r1", GREEDY), 4.0)
        assert tokens == offline[1]
        assert (result.prefilled_where, result.prefilled_why) == ("local", "no_room")
        assert router.sent == [False, True] and router.withdrawn == ["r1"]
        while not prefill.whole.early_starts["dropped"]:
            await asyncio.sleep(0.01)
        await until_idle(prefill, decode)
        assert pushes == [] and prefill.whole.early_starts["claimed"] == 0
        await sink.close()

    asyncio.run(main())


def test_a_hand_over_whose_lease_has_ended_is_not_started_early(roles, offline):
    """A hand-over read after its lease's deadline (its prefill replica was stopped while it
    was sent) is not computed: nothing of it could be pushed any more."""
    from kvtransfer import KVDestination
    from contracts.messages import PrefillRequest

    prefill, _, _, decode = roles

    async def main():
        await _connected(decode, prefill, offline)
        address = await decode.sink.start()
        for rid, deadline in (("stale", time.time() - 1), ("live", time.time() + 5)):
            dest = KVDestination(rid, decode.endpoint.endpoint_id, (), 0, deadline)
            assert early_sink(address).submit(prefill.publisher.publisher_id, PrefillRequest(
                tuple(PROMPTS[1]), GREEDY, dest,
                decode.endpoint.info(), address))
        while "live" not in prefill.whole.early.unclaimed:
            await asyncio.sleep(0.01)
        assert "stale" not in prefill.whole.early.unclaimed
        prefill.whole.early.withdraw("live")
        await until_idle(prefill, decode)

    asyncio.run(main())


def test_without_early_start_the_sink_takes_no_hand_over(offline):
    """``early_start`` off: the decode replica's sink refuses early starts (the replica choice
    finds no sink to send through), and the answer still comes on it."""
    fabric = LocalFabric()
    prefill = PrefillServer(CONFIG, "local", fabric=fabric)
    handle = _handle(prefill)
    decode = DecodeServer(CONFIG, "local", handle, 5.0, fabric=fabric, disaggregation=ALWAYS,
                          early_start=False)
    router = EarlyRouter(prefill)
    register_early_router(handle.deployment_name, router)

    async def main():
        await _connected(decode, prefill, offline)
        assert early_sink(decode.sink.address) is None
        handle.hold_return = asyncio.Event()
        started = time.monotonic()
        tokens, _ = await generate(decode, TokenSink(), PROMPTS[1], "r1", GREEDY)
        assert tokens == offline[1] and time.monotonic() - started < 4.0
        assert router.sent == [] and prefill.whole.early_starts["claimed"] == 0
        handle.hold_return.set()

    try:
        asyncio.run(main())
    finally:
        for server in (prefill, decode):
            server.close()


def test_the_first_token_is_published_ahead_of_the_kv(roles, offline, monkeypatch):
    """The prefill replica's first token reaches the ingress as the prefill step ends, while
    the push has not even started: the request then has the offline tokens, once each."""
    prefill, _, _, decode = roles
    real_push = prefill.endpoint.push
    slow = []

    def push(*args, **kwargs):
        time.sleep(0.3)  # the engine thread's push, late
        slow.append(time.time())
        return real_push(*args, **kwargs)

    async def main():
        await _connected(decode, prefill, offline)
        monkeypatch.setattr(prefill.endpoint, "push", push)
        at = []
        tokens, result = await generate(decode, TokenSink(), PROMPTS[1], "r1", GREEDY, at)
        assert tokens == offline[1] and result.prefilled_where == "remote"
        assert at[0] < slow[0] < result.timing.prefill_returned
        await until_idle(prefill, decode)

    asyncio.run(main())


def test_a_hand_over_released_after_its_first_token_goes_on_from_it(roles, offline,
                                                                    monkeypatch):
    """The first token is out, then the push fails: the decode replica prefills the prompt
    itself and goes on from that token (not a second first token); the tokens are the
    offline ones, once each, and both roles end idle."""
    from kvtransfer import TransferError

    prefill, _, _, decode = roles

    def push(*_args, **_kwargs):
        time.sleep(0.3)
        raise TransferError("the push failed (injected)")

    async def main():
        await _connected(decode, prefill, offline)
        monkeypatch.setattr(prefill.endpoint, "push", push)
        tokens, result = await generate(decode, TokenSink(), PROMPTS[1], "r1", GREEDY)
        assert tokens == offline[1] and result.num_output_tokens == len(tokens)
        assert (result.prefilled_where, result.prefilled_why) == ("local",
                                                                   "prefill_unavailable")
        await until_idle(prefill, decode)

    asyncio.run(main())


def test_a_first_token_that_ends_the_request_comes_with_the_admission(roles, offline):
    """A request of one token: its first token is not taken ahead of the KV (it would free
    blocks still being written); it ends once the KV has landed, and nothing is left held."""
    prefill, _, _, decode = roles
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def main():
        await _connected(decode, prefill, offline)
        at = []
        tokens, result = await generate(decode, TokenSink(), PROMPTS[1], "r1", one, at)
        assert tokens == offline[1][:1] and result.finish_reason == "length"
        assert at[0] >= result.timing.prefill_returned
        await until_idle(prefill, decode)

    asyncio.run(main())
