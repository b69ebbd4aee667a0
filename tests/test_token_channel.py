"""The token channel on its own (no Ray): one frame per engine step per ingress, deltas reach
their request's handler with the step's timestamp, a request's route ends with its last delta,
and a publisher with the wrong key or a lost connection fails its requests instead of hanging."""

import asyncio
import threading

import pytest

from contracts import StreamAddress, TokenChannelLost, TokenPublisher, TokenSink
from engine.outputs import RequestOutput


def _run(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _publish_from_thread(publisher, outputs, produced_at=None):
    """The engine thread publishes; here a plain thread stands in for it."""
    t = threading.Thread(target=publisher.publish, args=(outputs, produced_at))
    t.start()
    t.join()


def test_one_frame_per_step_carries_every_request_of_that_ingress():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        address = await sink.start()
        got = {"a": [], "b": []}
        for rid in got:
            sink.register(rid, lambda d, at, rid=rid: got[rid].append((d, at)))
        conn = await pub.connect(address)
        routes = {rid: pub.route(rid, conn) for rid in got}
        _publish_from_thread(pub, [RequestOutput("a", [5], [-0.5], num_output_tokens=1),
                                   RequestOutput("b", [7], num_output_tokens=1)], 100.0)
        _publish_from_thread(pub, [RequestOutput("a", [6], [-0.25], True, "length", None, 2, 3),
                                   RequestOutput("b", [8], num_output_tokens=2)], 101.0)
        last = await routes["a"].done
        while len(got["b"]) < 2:
            await asyncio.sleep(0.01)
        assert sink.num_frames == 2  # two steps, two requests each: two frames
        (d1, at1), (d2, at2) = got["a"]
        assert (d1.token_ids, d1.logprobs, d1.finished, at1) == ([5], [-0.5], False, 100.0)
        assert (d2.token_ids, d2.finish_reason, d2.num_output_tokens, d2.num_cached_tokens,
                at2) == ([6], "length", 2, 3, 101.0)
        assert last.finish_reason == "length" and routes["a"].first_at == 100.0
        assert not routes["b"].done.done() and pub.num_routes == 1
        await pub.close()
        await sink.close()

    _run(main())


def test_outputs_for_a_closed_event_loop_are_dropped_not_raised(caplog):
    """The engine thread publishes a step whose request's connection belongs to an event loop
    that has closed (a replica shutting down): the outputs are dropped with a warning, and the
    engine thread, which would otherwise die of it, goes on."""
    from contracts.token_channel import _Connection

    loop = asyncio.new_event_loop()
    publisher = TokenPublisher()
    conn = _Connection(StreamAddress("127.0.0.1", 1, b"k", "s"), None, loop)
    publisher.route("r1", conn)
    loop.close()
    with caplog.at_level("WARNING", logger="contracts.token_channel"):
        publisher.publish([RequestOutput("r1", [7], finished=True)])
    assert "closed event loop" in caplog.text


def test_unrouted_and_unregistered_requests_are_dropped():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        conn = await pub.connect(await sink.start())
        pub.route("kept", conn)
        seen = []
        sink.register("kept", lambda d, at: seen.append(d.request_id))
        _publish_from_thread(pub, [RequestOutput("other", [1]), RequestOutput("kept", [2])])
        pub.unroute("kept")
        _publish_from_thread(pub, [RequestOutput("kept", [3])])
        await asyncio.sleep(0.2)
        assert seen == ["kept"] and sink.num_frames == 1
        await pub.close()
        await sink.close()

    _run(main())


def test_a_wrong_key_is_refused_and_its_requests_fail():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        real = await sink.start()
        forged = StreamAddress(real.host, real.port, "not-the-key", real.sink_id)
        seen = []
        sink.register("r", lambda d, at: seen.append(d))
        route = pub.route("r", await pub.connect(forged))
        _publish_from_thread(pub, [RequestOutput("r", [1])])
        with pytest.raises(TokenChannelLost):
            await route.done
        assert seen == [] and sink.num_frames == 0
        await sink.close()

    _run(main())


def test_a_lost_ingress_fails_the_requests_routed_to_it():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        conn = await pub.connect(await sink.start())
        route = pub.route("r", conn)
        await sink.close()  # the ingress replica goes away: its connections close
        with pytest.raises(TokenChannelLost):
            await asyncio.wait_for(route.done, 10)
        with pytest.raises(TokenChannelLost):
            pub.route("late", conn)

    _run(main())


def test_fail_all_fails_every_route():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        conn = await pub.connect(await sink.start())
        routes = [pub.route(rid, conn) for rid in ("a", "b")]
        threading.Thread(target=pub.fail_all, args=(RuntimeError("engine died"),)).start()
        for route in routes:
            with pytest.raises(RuntimeError, match="engine died"):
                await route.done
        await pub.close()
        await sink.close()

    _run(main())


def test_a_request_id_in_flight_cannot_be_routed_again():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        conn = await pub.connect(await sink.start())
        first = pub.route("same", conn)
        with pytest.raises(ValueError, match="already in use"):
            pub.route("same", conn)
        assert pub._routes["same"] is first
        await pub.close()
        await sink.close()

    _run(main())


def test_one_connection_per_ingress_however_many_requests():
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        address = await sink.start()
        conns = await asyncio.gather(*[pub.connect(address) for _ in range(5)])
        assert all(c is conns[0] for c in conns)
        await pub.close()
        await sink.close()

    _run(main())


def test_a_result_follows_its_last_delta_on_the_same_connection():
    """The answer's one path back: the result frame comes behind the request's tokens."""
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        order = []
        sink.register("r", lambda d, at: order.append(("delta", d.token_ids)),
                      lambda rec: order.append(("end", rec)))
        conn = await pub.connect(await sink.start())
        route = pub.route("r", conn)
        _publish_from_thread(pub, [RequestOutput("r", [4], num_output_tokens=1)])
        _publish_from_thread(pub, [RequestOutput("r", [5], None, True, "stop", None, 2)])
        await route.done
        pub.end(route, "r", {"usage": 2})
        while len(order) < 3:
            await asyncio.sleep(0.01)
        assert order == [("delta", [4]), ("delta", [5]), ("end", {"usage": 2})]
        await pub.close()
        await sink.close()

    _run(main())


def test_a_dropped_connection_tells_the_requests_that_had_frames_on_it():
    """Requests with tokens but no result on a connection that drops are told (the ingress
    then moves or ends them); ended ones and ones never seen there are not."""
    async def main():
        sink, pub = TokenSink(), TokenPublisher()
        lost = []
        for rid in ("mid", "ended", "unseen"):
            sink.register(rid, lambda d, at: None, lambda rec: None,
                          lambda rid=rid: lost.append(rid))
        conn = await pub.connect(await sink.start())
        routes = {rid: pub.route(rid, conn) for rid in ("mid", "ended")}
        _publish_from_thread(pub, [RequestOutput("mid", [1]),
                                   RequestOutput("ended", [2], None, True, "stop", None, 1)])
        await asyncio.sleep(0.1)
        pub.end(routes["ended"], "ended", {})
        await asyncio.sleep(0.1)
        await pub.close()  # the decode replica's side closes
        while not lost:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert lost == ["mid"]
        await sink.close()

    _run(main())


# -- early starts: a request sent ahead of its Serve call --------------------------------------
def _early_pair():
    """An early-start sink and a publisher that records what the sink sends it."""
    sink, pub = TokenSink(early_start=True), TokenPublisher("replica-a")
    got = {"submit": [], "withdraw": []}
    pub.on_submit = lambda conn, req: got["submit"].append((conn, req))
    pub.on_withdraw = got["withdraw"].append
    return sink, pub, got


async def _until(cond, timeout=5.0):
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_an_early_start_reaches_its_publisher_and_its_frames_wait_for_the_claim():
    """The sink sends the request over the connection of the publisher named (by its replica
    id); what the held request publishes, its result included, reaches the ingress only once
    the claim comes, in order, and what follows the claim goes out at once."""
    from contracts.messages import GenerateRequest
    from contracts.token_channel import early_sink
    from engine.sampling_params import SamplingParams

    async def main():
        sink, pub, got = _early_pair()
        address = await sink.start()
        assert early_sink(address) is sink
        order = []
        sink.register("r", lambda d, at: order.append(("delta", d.token_ids)),
                      lambda rec: order.append(("end", rec)))
        req = GenerateRequest((1, 2, 3), SamplingParams(max_tokens=3), "r", address)
        assert not sink.submit("replica-a", req)  # not connected yet: no early start
        conn = await pub.connect(address)
        await _until(lambda: "replica-a" in sink._publishers)
        assert not sink.submit("replica-b", req)  # another replica: not connected
        assert sink.submit("replica-a", req)
        await _until(lambda: got["submit"])
        (on, sent), = got["submit"]
        assert on is conn and sent == req
        route = pub.route("r", conn, held=True)
        pub.publish([RequestOutput("r", [])])
        _publish_from_thread(pub, [RequestOutput("r", [4], num_output_tokens=1)], 7.0)
        await asyncio.sleep(0.2)
        assert order == [] and sink.num_frames == 0 and route.first_at == 7.0
        pub.claim("r")
        _publish_from_thread(pub, [RequestOutput("r", [5], None, True, "stop", None, 2)])
        await route.done
        pub.end(route, "r", {"usage": 2})
        await _until(lambda: len(order) == 4)
        assert order == [("delta", []), ("delta", [4]), ("delta", [5]), ("end", {"usage": 2})]
        sink.withdraw("replica-a", "other")
        await _until(lambda: got["withdraw"] == ["other"])
        await pub.close()
        await sink.close()
        assert early_sink(address) is None

    _run(main())


def test_a_dropped_early_start_sends_nothing_not_even_what_it_makes_later():
    """The request's call went to another replica: neither what it held nor what the engine
    publishes after the drop (its result included) reaches the ingress, which now follows the
    other replica's frames under the same id."""
    async def main():
        sink, pub, _ = _early_pair()
        seen = []
        sink.register("r", lambda d, at: seen.append(d.token_ids), lambda rec: seen.append(rec))
        conn = await pub.connect(await sink.start())
        route = pub.route("r", conn, held=True)
        _publish_from_thread(pub, [RequestOutput("r", [1])])
        await asyncio.sleep(0.05)
        pub.drop("r")
        pub.end(route, "r", {"late": True})
        pub.route("kept", conn)  # an ordinary request on the same connection still flows
        sink.register("kept", lambda d, at: seen.append(("kept", d.token_ids)))
        _publish_from_thread(pub, [RequestOutput("r", [2]), RequestOutput("kept", [3])])
        await _until(lambda: seen)
        await asyncio.sleep(0.1)
        assert seen == [("kept", [3])] and pub.num_routes == 1
        await pub.close()
        await sink.close()

    _run(main())


def test_only_a_sink_that_takes_early_starts_is_found_and_submits_from_any_thread():
    from contracts.token_channel import early_sink

    async def main():
        plain = TokenSink()
        assert early_sink(await plain.start()) is None
        sink, pub, got = _early_pair()
        address = await sink.start()
        await pub.connect(address)
        await _until(lambda: sink._publishers)
        sent = []
        t = threading.Thread(target=lambda: sent.append(sink.submit("replica-a", "x")))
        t.start()
        t.join()
        await _until(lambda: got["submit"])
        assert sent == [True] and got["submit"][0][1] == "x"
        await pub.close()
        await sink.close()
        await plain.close()

    _run(main())
