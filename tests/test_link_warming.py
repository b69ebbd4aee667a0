"""Links warmed before any request needs them: decode replicas list their KV endpoints in a
directory, prefill replicas open a link to each as it appears (NIXL over host memory here, and
the in-process transport), the first request's push finds the link open, and receivers ignore
the warming's one-block write."""

import asyncio
import time

import pytest

from contracts import TokenSink
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer.backends.local import LocalFabric
from kvtransfer.directory import DictStore, LinkWarmer, PeerDirectory
from kvtransfer.types import EndpointInfo, KVLayout
from prefill_worker.server import PrefillServer
from tests.models import random_prompts
from tests.roles import PrefillHandle, generate, until_idle

CONFIG = EngineConfig(model="tiny", num_blocks=64, max_num_seqs=4, show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = random_prompts([40], vocab=512, seed=5)[0]


def _info(endpoint_id: str) -> EndpointInfo:
    layout = KVLayout(model="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=8,
                      block_size=16)
    return EndpointInfo(endpoint_id=endpoint_id, backend="local", layout=layout,
                        layout_hash=layout.compat_hash(), protocol_version=1, num_blocks=4,
                        connection=b"")


def test_the_directory_lists_fresh_entries_of_its_scope_only():
    store, now = DictStore(), [1000.0]
    app = PeerDirectory("app", store, ttl_s=30, clock=lambda: now[0])
    other = PeerDirectory("other", store, ttl_s=30, clock=lambda: now[0])
    app.publish(_info("a"))
    now[0] += 20
    app.publish(_info("b"))
    other.publish(_info("x"))
    assert sorted(p.endpoint_id for p in app.peers()) == ["a", "b"]
    now[0] += 15  # a's entry is 35 s old: its replica stopped refreshing it
    assert [p.endpoint_id for p in app.peers()] == ["b"]
    app.withdraw("b")
    assert app.peers() == [] and [p.endpoint_id for p in other.peers()] == ["x"]
    assert store.keys("kv-receivers/app/") == ["kv-receivers/app/a"]  # stale, kept a while
    now[0] += 10 * 30  # ten TTLs without a refresh: its replica crashed; the reader deletes it
    assert app.peers() == [] and store.keys("kv-receivers/app/") == []


@pytest.mark.e2e
def test_the_cluster_store_lists_entries_and_bounds_every_call(ray_cluster):
    """The directory over Ray's own key-value store (the GCS), as replicas use it: every call
    carries a bound (a GCS that does not answer fails the turn instead of hanging it)."""
    from kvtransfer.directory import RayKVStore

    store = RayKVStore(timeout_s=5.0)
    app = PeerDirectory("store-test", store, ttl_s=30)
    app.publish(_info("a"))
    app.publish(_info("b"))
    assert sorted(p.endpoint_id for p in app.peers()) == ["a", "b"]
    app.withdraw("a")
    assert [p.endpoint_id for p in app.peers()] == ["b"]
    app.withdraw("b")
    assert store.get("kv-receivers/store-test/b") is None and app.peers() == []


def _until(check, timeout_s=20.0):
    end = time.time() + timeout_s
    while not check():
        assert time.time() < end, "not reached in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny").generate([PROMPT], GREEDY)[0].token_ids


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_a_new_decode_replica_is_warmed_and_its_first_push_finds_the_link_open(
        backend, offline):
    directory = PeerDirectory("app", DictStore())
    kw = {"fabric": LocalFabric()} if backend == "local" else {}
    prefill = PrefillServer(CONFIG, backend, directory, **kw)
    prefill.warmer.interval_s = 0.1
    time.sleep(0.3)
    assert prefill.warmer.links == {}  # nobody listed yet
    decode = DecodeServer(CONFIG, backend, PrefillHandle(prefill), 10.0, directory, **kw, disaggregation=ALWAYS)
    peer = decode.endpoint.endpoint_id
    try:
        _until(lambda: prefill.warmer.summary().get(peer, {}).get("state") == "warm")
        assert prefill.kv_load()["links"][peer]["backend"] == backend

        sender = prefill.endpoint.backends[backend]
        first_push_was_connected = []
        connect = sender.connect

        def spy(info):
            if backend == "nixl":
                first_push_was_connected.append(info.endpoint_id in sender._peers)
            else:
                first_push_was_connected.append(True)
            connect(info)

        sender.connect = spy

        async def run():
            sink = TokenSink()
            try:
                tokens, result = await generate(decode, sink, PROMPT, "r1", GREEDY)
                await until_idle(decode, prefill)
            finally:
                await sink.close()
            return tokens, result

        tokens, result = asyncio.run(run())
        assert tokens == offline and result.transfer.backend == backend
        assert first_push_was_connected == [True]
        assert not decode.endpoint.ranks[0]._landed_early  # the warming's write was ignored
        assert prefill.warmer.scan() == []  # warm once, not at every scan
    finally:
        prefill.close()
        decode.close()
    assert directory.peers() == []  # the decode replica withdrew its entry


def test_a_listed_peer_that_is_gone_is_a_failed_link_not_a_stuck_one():
    directory = PeerDirectory("app", DictStore())
    fabric = LocalFabric()
    gone = DecodeServer(CONFIG, "local", PrefillHandle(None), 10.0, fabric=fabric, disaggregation=ALWAYS)
    directory.publish(gone.endpoint.info())  # listed, then the replica dies without leaving
    gone.close()
    prefill = PrefillServer(CONFIG, "local", directory, fabric=fabric)
    try:
        _until(lambda: prefill.warmer.summary().get(gone.endpoint.endpoint_id, {})
               .get("state") == "failed")
        assert prefill.endpoint.held_blocks == 0
    finally:
        prefill.close()


def test_a_listed_peer_of_another_kv_layout_is_refused_once_and_counted(caplog):
    """A decode replica whose KV layout is not the prefill replica's is a configuration error:
    its link is marked ``mismatch`` at once (an error in the log, the owner's counter called),
    never warmed nor tried again, and nothing is held."""
    directory = PeerDirectory("app", DictStore())
    fabric = LocalFabric()
    other = DecodeServer(CONFIG.model_copy(update={"block_size": 32}), "local",
                         PrefillHandle(None), 10.0, fabric=fabric, disaggregation=ALWAYS)
    directory.publish(other.endpoint.info())
    prefill = PrefillServer(CONFIG, "local", fabric=fabric)
    counted = []
    warmer = LinkWarmer(prefill.endpoint, directory, prefill.aengine.submit,
                        on_mismatch=counted.append)
    try:
        import logging
        with caplog.at_level(logging.ERROR, logger="kvtransfer.directory"):
            assert warmer.scan() == []
        pid = other.endpoint.endpoint_id
        assert warmer.summary()[pid]["state"] == "mismatch"
        assert [p.endpoint_id for p in counted] == [pid]
        assert any("block_size" in r.getMessage() for r in caplog.records)
        assert warmer.scan() == [] and len(counted) == 1  # said once, not at every scan
        assert prefill.endpoint.held_blocks == 0
    finally:
        prefill.close()
        other.close()
