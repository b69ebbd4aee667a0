"""The engine on its own thread, driven from asyncio (engine.async_engine), as the role servers
run it: whole requests (concurrent ones too) end as the offline engine's do; a caller that
goes away aborts its request and gives its blocks back; a failing command fails only its
caller; a dying engine thread fails every waiter and every later call; tickers run on the
engine thread; an outputs hook gets each step's outputs at once."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from contracts.role import RoleDeployment
from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.errors import RequestIdInUse
from tests.models import random_prompts

CONFIG = dict(model="tiny", num_blocks=64, max_num_seqs=8, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 33, 9], vocab=256, seed=3)


@pytest.fixture(scope="module")
def offline():
    return [c.token_ids for c in LLM(**CONFIG).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def aengine():
    engine = AsyncEngine(EngineConfig(**CONFIG))
    yield engine
    engine.shutdown()


def _idle(aengine) -> bool:
    e = aengine.engine
    return not e.has_unfinished_requests() and e.pool.num_used_blocks == 0


async def _until(check, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _last(out) -> tuple:
    """A whole request's last output: its token, how many it made, why it ended."""
    return out.new_token_ids[-1], out.num_output_tokens, out.finish_reason


def test_whole_requests_concurrently_end_as_offline(aengine, offline):
    async def main():
        return await asyncio.gather(*(aengine.run(p, GREEDY, f"r{i}")
                                      for i, p in enumerate(PROMPTS)))

    assert [_last(o) for o in asyncio.run(main())] == [(t[-1], 12, "length") for t in offline]
    assert _idle(aengine)


def test_a_caller_that_goes_away_aborts_its_request(aengine):
    async def main():
        long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        task = asyncio.create_task(aengine.run(PROMPTS[1], long, "gone"))
        await _until(lambda: aengine.engine.stats.output_tokens > 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: _idle(aengine))

    asyncio.run(main())
    assert aengine.engine.scheduler.finished_by_reason.get("abort") == 1


def test_a_failing_command_fails_its_caller_only(aengine, offline):
    async def main():
        with pytest.raises(ValueError, match="already in use"):
            await aengine.call(lambda e: (e.add_request(PROMPTS[0], GREEDY, "dup"),
                                          e.add_request(PROMPTS[0], GREEDY, "dup")))
        await aengine.call(lambda e: e.abort_request("dup"))
        return await aengine.run(PROMPTS[0], GREEDY, "after")

    assert _last(asyncio.run(main())) == (offline[0][-1], 12, "length")
    assert aengine.error is None


def test_a_request_the_engine_refuses_fails_its_run_and_added_runs_once_taken(aengine):
    """``run`` posts the add without waiting for it: a refusal still reaches its caller (and
    leaves nothing behind), and ``added`` runs on the engine thread once the request is in."""
    async def main():
        with pytest.raises(ValueError, match="already in use"):
            await aengine.call(lambda e: e.add_request(PROMPTS[0], GREEDY, "taken"))
            await asyncio.wait_for(aengine.run(PROMPTS[1], GREEDY, "taken"), 10)
        # the refusal left the request that holds the id alone
        assert await aengine.call(lambda e: e.scheduler.find("taken")) is not None
        await aengine.call(lambda e: e.abort_request("taken"))
        threads = []
        out = await aengine.run(PROMPTS[0], GREEDY, "next",
                                added=lambda: threads.append(threading.current_thread().name))
        return out, threads

    out, threads = asyncio.run(main())
    assert out.finish_reason == "length" and threads == ["baton-engine"]
    assert _idle(aengine)


def test_a_second_run_under_a_running_id_is_refused_and_leaves_the_first(aengine, offline):
    async def main():
        first = asyncio.ensure_future(aengine.run(PROMPTS[0], GREEDY, "one"))
        await asyncio.sleep(0)
        with pytest.raises(RequestIdInUse):
            await asyncio.wait_for(aengine.run(PROMPTS[1], GREEDY, "one"), 10)
        return await asyncio.wait_for(first, 30)

    assert _last(asyncio.run(main())) == (offline[0][-1], 12, "length")
    assert _idle(aengine)


def test_commands_queued_when_the_engine_thread_dies_fail_too():
    """A command posted while the thread is in its last turn is failed with the rest, not left
    to wait for a thread that is gone."""
    aengine = AsyncEngine(EngineConfig(**CONFIG))
    entered, release = threading.Event(), threading.Event()

    def dying_ticker():
        entered.set()
        release.wait(10)
        raise RuntimeError("device lost")

    try:
        async def main():
            aengine.add_ticker(dying_ticker)
            assert await asyncio.to_thread(entered.wait, 10)
            queued = aengine.call(lambda e: "ran")  # posted during that turn
            task = asyncio.ensure_future(queued)
            await asyncio.sleep(0.05)
            release.set()
            with pytest.raises(EngineDeadError, match="device lost"):
                await asyncio.wait_for(task, 10)

        asyncio.run(main())
    finally:
        aengine.shutdown()


def test_a_wedged_engine_thread_fails_the_health_check_until_it_turns_again(aengine,
                                                                           monkeypatch):
    """A command that never returns (a hung device, a deadlock) leaves the thread alive but
    stuck: past ``WEDGED_S`` without a turn of its loop, the health check fails (Serve then
    replaces the replica); once it turns again, the check passes."""
    import time

    import engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "WEDGED_S", 0.3)
    release = threading.Event()
    aengine.check()
    stuck = aengine.submit(lambda e: release.wait(10))
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match="wedged"):
        aengine.check()
    release.set()
    stuck.result(timeout=10)
    time.sleep(0.1)
    aengine.check()


def test_a_dying_engine_thread_fails_every_waiter_and_later_calls():
    told = []
    aengine = AsyncEngine(EngineConfig(**CONFIG), on_error=told.append)
    try:
        def broken_step():
            raise RuntimeError("device lost")

        async def main():
            aengine.engine.step = broken_step
            with pytest.raises(EngineDeadError, match="device lost"):
                await asyncio.wait_for(aengine.run(PROMPTS[0], GREEDY, "x"), 10)
            with pytest.raises(EngineDeadError):
                aengine.submit(lambda e: None)
            aengine.abort("x")  # harmless once dead

        asyncio.run(main())
        assert len(told) == 1 and isinstance(told[0], EngineDeadError)
    finally:
        aengine.shutdown()


def test_tickers_and_the_outputs_hook_run_on_the_engine_thread():
    seen, threads = [], set()

    def hook(outputs):
        threads.add(threading.current_thread().name)
        seen.append([(o.request_id, tuple(o.new_token_ids), o.finished) for o in outputs])

    aengine = AsyncEngine(EngineConfig(**CONFIG), on_outputs=hook)
    ticks = []
    aengine.add_ticker(lambda: ticks.append(threading.current_thread().name))
    try:
        async def main():
            for i, p in enumerate(PROMPTS[:2]):
                await aengine.call(lambda e, p=p, i=i: e.add_request(p, GREEDY, f"h{i}"))
            await _until(lambda: sum(f for step in seen for *_, f in step) == 2)

        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert threads == {"baton-engine"} and set(ticks) == {"baton-engine"}
    for rid in ("h0", "h1"):  # every token once, in order, the last output finished
        mine = [out for step in seen for out in step if out[0] == rid]
        assert sum(len(toks) for _, toks, _ in mine) == GREEDY.max_tokens
        assert [f for *_, f in mine] == [False] * (len(mine) - 1) + [True]


def test_other_threads_read_the_snapshot_the_engine_thread_publishes(aengine, offline):
    """After its steps the engine thread publishes what others may know (counts, counters,
    finish reasons) and hands over the step and queue-time samples; the engine's own queues
    are left empty, so no reader drains them from another thread."""
    feed = aengine.feed
    assert feed.latest.stats.steps == 0 and feed.latest.kv_blocks_free > 0

    async def main():
        return await asyncio.gather(*(aengine.run(p, GREEDY, f"r{i}")
                                      for i, p in enumerate(PROMPTS)))

    asyncio.run(main())
    tokens = sum(len(o) for o in offline)
    snap = feed.latest
    assert snap.stats.output_tokens == tokens and snap.finished_by_reason == {"length": 4}
    assert snap.running == snap.waiting == snap.kv_blocks_used == 0
    assert snap.stats.prompt_tokens == sum(len(p) for p in PROMPTS)
    steps = feed.drain(feed.step_samples)
    assert len(steps) == snap.stats.steps
    assert sum(t for t, _ in steps) == pytest.approx(snap.stats.step_seconds)
    assert len(feed.drain(feed.queue_times)) == len(PROMPTS)
    assert not aengine.engine.step_samples and not aengine.engine.scheduler.queue_times
    assert feed.drain(feed.step_samples) == []  # taken once


def test_the_snapshot_follows_what_tickers_change(aengine):
    """A ticker's work changes the engine outside any step (a finished push gives its held
    blocks back): the snapshot shows it once that work is done, not only after the next step."""
    state = {"ticks": 0, "release": False}

    def ticker() -> bool:  # a transfer in flight for a few turns, then done: blocks released
        if not state["release"]:
            return False
        state["ticks"] += 1
        if state["ticks"] < 5:
            return True
        aengine.engine.release_held_blocks("held")
        state["release"] = False
        return False

    aengine.add_ticker(ticker)

    async def main():
        await aengine.run(PROMPTS[2], GREEDY.model_copy(update={"max_tokens": 1}), "held",
                          hold_blocks=True)
        await _until(lambda: aengine.feed.latest.kv_blocks_used > 0)
        state["release"] = True
        await _until(lambda: aengine.feed.latest.kv_blocks_used == 0)

    asyncio.run(main())
    assert state["ticks"] == 5


class _Role(RoleDeployment):
    def __init__(self, aengine):
        self.server = SimpleNamespace(aengine=aengine, close=lambda: None)


def test_a_role_replica_exits_once_a_rank_of_its_engine_dies():
    """A replica whose split engine lost a rank exits at once (after killing its other ranks),
    so Serve replaces it as a crashed replica instead of after three failed health checks;
    while the engine is healthy, or once it is being shut down, nothing happens."""
    aengine = AsyncEngine(EngineConfig(**{**CONFIG, "tensor_parallel_size": 2}))
    exits = []
    try:
        watch = _Role(aengine).watch_engine(period_s=0.02, exit_process=exits.append)
        asyncio.run(aengine.run(PROMPTS[0], GREEDY, "before"))
        assert not exits and watch.is_alive()
        (rank,) = aengine.engine.executor.others.procs
        killed = []
        aengine.engine.kill_ranks = lambda: killed.append(True)
        rank.kill()
        watch.join(10)
        assert exits == [1] and killed == [True] and not watch.is_alive()
    finally:
        aengine.shutdown()
    exits.clear()
    healthy = AsyncEngine(EngineConfig(**CONFIG))
    watch = _Role(healthy).watch_engine(period_s=0.02, exit_process=exits.append)
    healthy.shutdown()
    watch.join(5)
    assert not watch.is_alive() and exits == []
