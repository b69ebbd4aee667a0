"""The transfer contracts in one process: the local backend between the role servers as they
ship, a fake slow transport, the state machine, the layout handshake and lease release on every
path."""

import asyncio
import os
import time

import pytest
import torch

from contracts import TokenSink
from contracts.messages import PrefillRequest
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer import (KVDestination, KVEndpoint, KVLayout, LayoutMismatchError,
                        TransferError, TransferState)
from kvtransfer.backends.base import TransportBackend, block_runs
from kvtransfer.backends.local import LocalFabric
from kvtransfer.types import advance, check_compatible
from prefill_worker.server import PrefillServer
from tests.models import random_prompts
from tests.roles import (PrefillHandle, capture_landed_kv, capture_pushed_kv, generate,
                         run_to_idle, until_idle)

CONFIG = EngineConfig(model="tiny", num_blocks=128, show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LAYOUT = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4,
                  block_size=4)


@pytest.fixture(scope="module")
def pair():
    fabric = LocalFabric()
    prefill = PrefillServer(CONFIG, "local", fabric=fabric)
    decode = DecodeServer(CONFIG, "local", PrefillHandle(prefill), fabric=fabric, disaggregation=ALWAYS)
    pushed, landed = capture_pushed_kv(prefill), capture_landed_kv(decode)
    yield prefill, decode, pushed, landed
    prefill.close()
    decode.close()


def _run(pair, prompt, rid, params=GREEDY):
    prefill, decode, pushed, landed = pair
    tokens, result = run_to_idle(prefill, decode, prompt, rid, params)
    if result.transfer is not None and result.transfer.blocks_sent:
        assert torch.equal(pushed[rid], landed[rid])
    return tokens, result


def test_local_hand_over_matches_colocated_and_copies_bytes(pair):
    prompts = random_prompts([3, 16, 50], vocab=512, seed=21)
    expected = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]
    for i, (prompt, tokens) in enumerate(zip(prompts, expected)):
        got, result = _run(pair, prompt, f"a{i}")
        assert got == tokens
        assert result.transfer.blocks_sent == -(-len(prompt) // 16)
        assert result.transfer.bytes == pair[2][f"a{i}"].numel() * 4


def test_full_hit_on_decode_side_moves_nothing(pair):
    prompt = random_prompts([32], vocab=512, seed=22)[0]
    _run(pair, prompt, "b0")
    got, result = _run(pair, prompt, "b1")  # decode's own cache now has both blocks
    assert result.transfer.blocks_sent == 0 and result.transfer.blocks_skipped == 2
    assert got == LLM("tiny").generate([prompt], GREEDY)[0].token_ids


def test_first_token_can_finish_the_request(pair):
    got, result = _run(pair, [5, 6, 7], "c", SamplingParams(temperature=0, max_tokens=1))
    assert len(got) == 1 and result.finish_reason == "length" and result.transfer is not None


def test_abort_releases_the_receivers_lease(pair):
    _, decode, _, _ = pair

    async def main():
        dest = await decode.reserve(random_prompts([40], vocab=512, seed=23)[0], GREEDY, "d")
        assert decode.held_blocks == len(dest.block_ids) == 3
        decode.abort("d")
        await until_idle(decode)

    asyncio.run(main())


def test_expired_destination_fails_the_push_and_releases_both_sides(pair, monkeypatch):
    """(Nobody tells the decode side that the push failed here: its lease is fenced past the
    deadline for the longest a sender keeps a write, shortened here.)"""
    import kvtransfer.endpoint as kv_endpoint

    monkeypatch.setattr(kv_endpoint, "DRAIN_MAX_S", 0.2)
    prefill, decode, _, _ = pair
    prompt = random_prompts([20], vocab=512, seed=24)[0]

    async def main():
        dest = await decode.reserve(prompt, GREEDY, "e", timeout_s=0.0)
        with pytest.raises(TransferError, match="deadline"):
            await prefill.prefill(PrefillRequest(tuple(prompt), GREEDY, dest, decode.endpoint.info()))
        assert (await decode.landed("e")).state is TransferState.FAILED
        await until_idle(prefill, decode)

    asyncio.run(main())


def test_layout_mismatch_names_the_field():
    other = KVLayout(model="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=4,
                     block_size=4)
    with pytest.raises(LayoutMismatchError, match="dtype: local 'float32' != peer 'bfloat16'"):
        check_compatible(LAYOUT, other)
    with pytest.raises(LayoutMismatchError, match="protocol_version"):
        check_compatible(LAYOUT, LAYOUT, 1, 2)
    assert LAYOUT.compat_hash() == KVLayout(**LAYOUT.__dict__).compat_hash()
    assert LAYOUT.compat_hash() != other.compat_hash()


def test_state_only_moves_forward_and_failed_wins():
    S = TransferState
    assert advance(S.IN_FLIGHT, S.PENDING) is S.IN_FLIGHT
    assert advance(S.DONE, S.IN_FLIGHT) is S.DONE
    assert advance(S.DONE, S.FAILED) is S.FAILED
    assert advance(S.FAILED, S.DONE) is S.FAILED


def test_block_runs_coalesce_consecutive_pairs():
    assert block_runs([4, 5, 6, 9], [1, 2, 3, 4]) == [(4, 1, 3), (9, 4, 1)]
    assert block_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    # Block-major: one region per run, all layers of a block together.
    assert LAYOUT.regions([(4, 1, 3)], 0) == [(4 * LAYOUT.block_bytes, 3 * LAYOUT.block_bytes)]
    assert LAYOUT.regions([(4, 1, 3), (9, 7, 1)], 1) == [(1 * LAYOUT.block_bytes,
                                                          3 * LAYOUT.block_bytes),
                                                         (7 * LAYOUT.block_bytes,
                                                          LAYOUT.block_bytes)]


class SlowFake(TransportBackend):
    """Completes a write after ``polls`` checks (or never), like vLLM's fake connector."""
    name = "fake"

    def __init__(self, polls: int | None):
        super().__init__("fake", torch.zeros(1, 4, 1), LAYOUT)
        self.polls = polls

    def start_write(self, peer, transfer_id, src, dst, heads=None):
        return {"left": self.polls}

    def check_write(self, handle):
        if handle["left"] is None:
            return TransferState.IN_FLIGHT
        handle["left"] -= 1
        return TransferState.DONE if handle["left"] <= 0 else TransferState.IN_FLIGHT


def _fake_endpoint(polls):
    ep = KVEndpoint(torch.zeros(2, 8, 2, 2, 4, 4), LAYOUT, "local")
    ep.backends = {"local": SlowFake(polls)}  # as if "local" were slow
    return ep


@pytest.mark.parametrize("polls, expected", [(3, TransferState.DONE),
                                             (None, TransferState.FAILED)])
def test_send_lease_released_once_on_done_or_deadline(polls, expected, monkeypatch):
    import kvtransfer.endpoint as endpoint

    monkeypatch.setattr(endpoint, "DRAIN_MAX_S", 0.3)
    ep = _fake_endpoint(polls)
    peer = ep.info()
    released = []
    dest = KVDestination("r1", "peer", (1, 2), 0, time.time() + 0.2)
    t = ep.push(peer, dest, [3, 4], on_finish=released.append)
    assert t.state is TransferState.IN_FLIGHT and ep.held_blocks == 2
    assert ep.wait(t, timeout=5) is expected
    assert released == [t] and ep.held_blocks == 0
    ep.abort(t.transfer_id)  # a late abort changes nothing and releases nothing twice
    assert released == [t]


class TimedFake(SlowFake):
    """A write that ends at ``ends_at`` (``time.time()``), polled or not."""

    def __init__(self, ends_at: float):
        super().__init__(None)
        self.ends_at = ends_at

    def check_write(self, handle):
        return TransferState.DONE if time.time() >= self.ends_at else TransferState.IN_FLIGHT


@pytest.mark.parametrize("ends_after_s, expected", [(0.3, TransferState.DONE),
                                                    (None, TransferState.FAILED)])
def test_a_write_in_flight_at_its_deadline_keeps_its_source_blocks_until_it_ends(
        ends_after_s, expected, monkeypatch):
    """A write cannot be taken back once started (a CUDA copy runs to its end): past its
    deadline the push keeps it, and its source blocks, until the transport says it has ended
    (then DONE: it landed), for at most DRAIN_MAX_S, and only then fails. So the push's end
    means nothing reads those blocks or writes the receiver's any more."""
    import kvtransfer.endpoint as endpoint

    monkeypatch.setattr(endpoint, "DRAIN_MAX_S", 0.6)
    ep = _fake_endpoint(None)
    start = time.time()
    ep.backends = {"local": TimedFake(start + (ends_after_s or 60))}
    dest = KVDestination("r3", "peer", (1, 2), 0, start + 0.1)
    t = ep.push(ep.info(), dest, [3, 4])
    while time.time() < start + 0.2:  # past the deadline, the write not over
        ep.poll()
    assert t.state is TransferState.IN_FLIGHT and ep.held_blocks == 2
    assert ep.wait(t, timeout=5) is expected and ep.held_blocks == 0
    ended = time.time() - start
    assert (0.3 <= ended < 0.5) if ends_after_s else (0.7 <= ended < 1.0), ended
    if expected is TransferState.FAILED:
        assert "deadline" in t.error


class SettlingFake(SlowFake):
    """A write that ends once waited for (a copy between this node's GPUs), never by polls."""

    def settle_write(self, handle):
        handle["left"] = 0


def test_a_settling_poll_ends_local_writes_in_that_poll():
    ep = _fake_endpoint(None)
    ep.backends = {"local": SettlingFake(None)}
    dest = KVDestination("r2", "peer", (1, 2), 0, time.time() + 30)
    t = ep.push(ep.info(), dest, [3, 4])
    assert ep.poll() and t.state is TransferState.IN_FLIGHT  # polled: still in flight
    assert not ep.poll(settle=True) and t.state is TransferState.DONE and ep.held_blocks == 0


def test_push_at_step_end_starts_the_push_before_the_engine_steps_again():
    """transfer.push_at_step_end: a prefill replica busy with a long prompt (chunked over many
    steps) starts a short request's push as the step that prefilled it returns, not after the
    next step; the tokens are the colocated ones and no block stays held."""
    fabric = LocalFabric()
    config = EngineConfig(model="tiny", num_blocks=128, max_num_batched_tokens=32,
                          show_progress=False)
    prefill = PrefillServer(config, "local", push_at_step_end=True, fabric=fabric)
    decode = DecodeServer(CONFIG, "local", PrefillHandle(prefill), fabric=fabric,
                          disaggregation=ALWAYS)
    events: list[tuple] = []
    engine, ep = prefill.aengine.engine, prefill.endpoint
    step, push = engine.step, ep.push

    def logged_step():
        outs = step()
        events.append(("step", {o.request_id for o in outs if o.finished}))
        return outs

    def logged_push(peer, dest, src_block_ids, on_finish=None):
        events.append(("push", dest.request_id))
        return push(peer, dest, src_block_ids, on_finish)

    engine.step, ep.push = logged_step, logged_push
    long_prompt, *short = random_prompts([600, 5, 9, 7], vocab=512, seed=25)

    async def main():
        sinks = [TokenSink() for _ in range(4)]
        jobs = [generate(decode, sinks[0], long_prompt, "long", GREEDY)]
        await asyncio.sleep(0.05)  # the long prompt's chunks are under way
        jobs += [generate(decode, sink, p, f"s{i}", GREEDY) for i, (sink, p)
                 in enumerate(zip(sinks[1:], short))]
        results = await asyncio.gather(*jobs)
        await until_idle(prefill, decode)
        return results

    try:
        results = asyncio.run(main())
        assert prefill.endpoint.held_blocks == 0
        assert prefill.aengine.submit(lambda e: dict(e.scheduler.held)).result(5) == {}
    finally:
        prefill.close()
        decode.close()
    expected = [o.token_ids for o in LLM("tiny").generate([long_prompt, *short], GREEDY)]
    assert [tokens for tokens, _ in results] == expected
    pushes = [i for i, e in enumerate(events) if e[0] == "push"]
    assert len(pushes) == 4
    for i in pushes:  # the event before a push is the step that finished its request
        last_step = next(e for e in reversed(events[:i]) if e[0] == "step")
        assert events[i][1] in last_step[1], events[max(0, i - 3):i + 1]
    assert sum(1 for e in events if e[0] == "step") >= 600 // 32  # chunked beside the others


def test_default_backend_per_placement():
    from kvtransfer import default_backend
    assert default_backend(same_node=True, device_type="cuda") == "cuda_ipc"
    assert default_backend(same_node=False, device_type="cuda") == "nixl"
    assert default_backend(same_node=True, device_type="cpu") == "nixl"
    with pytest.raises(ValueError, match="unknown backend 'rdma'"):
        KVEndpoint(torch.zeros(2, 4, 2, 2, 4, 4), LAYOUT, "rdma")


def _info(endpoint_id, node, device, backends):
    from kvtransfer import EndpointInfo
    return EndpointInfo(endpoint_id, backends[0], LAYOUT, "", 1, 8, node_id=node, device=device,
                        connections=tuple((b, b"") for b in backends))


GPU_AUTO = ("cuda_ipc", "nixl")


@pytest.mark.parametrize("configured, sender, receiver, expected", [
    # auto: CUDA IPC within a node, NIXL across nodes; NIXL on CPU
    ("auto", ("A", "cuda:0", GPU_AUTO), ("A", "cuda:1", GPU_AUTO), "cuda_ipc"),
    ("auto", ("A", "cuda:0", GPU_AUTO), ("B", "cuda:0", GPU_AUTO), "nixl"),
    ("auto", ("A", "cpu", ("nixl",)), ("A", "cpu", ("nixl",)), "nixl"),
    ("auto", ("A", "cuda:0", GPU_AUTO), ("A", "cpu", ("nixl",)), "nixl"),
    # explicit: used as configured, where the pair can use it
    ("nixl", ("A", "cuda:0", ("nixl",)), ("A", "cuda:0", ("nixl",)), "nixl"),
    ("nccl", ("A", "cuda:0", ("nccl",)), ("B", "cuda:0", ("nccl",)), "nccl"),
    ("cuda_ipc", ("A", "cuda:0", ("cuda_ipc",)), ("B", "cuda:0", ("cuda_ipc",)),
     "needs both engines on one node: sender s on node A .* receiver r on node B"),
    ("nixl", ("A", "cuda:0", ("nixl",)), ("A", "cuda:0", ("nccl",)),
     "no common transport.*sender serves \\['nixl'\\], the receiver \\['nccl'\\]"),
])
def test_the_transport_is_chosen_per_pair(configured, sender, receiver, expected):
    from kvtransfer import TransportUnavailableError, choose_backend
    local, peer = _info("s", *sender), _info("r", *receiver)
    if expected in ("cuda_ipc", "nixl", "nccl"):
        assert choose_backend(configured, local, peer) == expected
    else:
        with pytest.raises(TransportUnavailableError, match=expected):
            choose_backend(configured, local, peer)


def test_an_auto_endpoint_serves_every_backend_a_pair_may_need():
    """On CPU ``auto`` serves NIXL only; the info lists each backend with its connection data,
    and a push picks one per receiver."""
    cpu = KVEndpoint(torch.zeros(2, 4, 2, 2, 4, 4), LAYOUT, "auto", node_id="A",
                     progress_thread=False)
    try:
        info = cpu.info()
        assert info.backends == ("nixl",) and info.node_id == "A" and info.device == "cpu"
        assert info.via("nixl").connection == info.connection != b""
        assert cpu.choose(info) == "nixl"
    finally:
        cpu.close()
    with pytest.raises(TypeError, match="options \\['fabric'\\] are taken by none"):
        KVEndpoint(torch.zeros(2, 4, 2, 2, 4, 4), LAYOUT, "nixl", fabric=LocalFabric())


def test_auto_serves_the_backends_this_install_can_build(monkeypatch, caplog):
    """``auto`` on a host where one of its backends cannot be imported (NIXL not installed)
    serves the others and says so; a backend named explicitly still fails loudly."""
    import kvtransfer.backends as backends
    from kvtransfer.backends.local import LocalBackend

    class Unimportable(LocalBackend):
        name = "nixl"

        def __init__(self, *args, **kwargs):
            raise ModuleNotFoundError("No module named 'nixl'")

    real = backends.backend_class
    monkeypatch.setattr(backends, "backend_class",
                        lambda name: Unimportable if name == "nixl" else real(name))
    monkeypatch.setattr(backends, "backends_for",
                        lambda configured, _device: ("local", "nixl") if configured == "auto"
                        else (configured,))
    cache = torch.zeros(2, 4, 2, 2, 4, 4)
    ep = KVEndpoint(cache, LAYOUT, "auto")
    try:
        assert list(ep.backends) == ["local"] and ep.info().backends == ("local",)
        assert "transfer backend nixl unavailable" in caplog.text
    finally:
        ep.close()
    with pytest.raises(ImportError, match="nixl"):
        KVEndpoint(cache, LAYOUT, "nixl")


def test_importing_nixl_keeps_the_process_log_handlers():
    """nixl's import reconfigures logging and closes every handler; a Serve replica's log (a
    buffering handler in front of a file) must keep working after the backend is imported."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import logging, logging.handlers, sys, tempfile
        path = tempfile.mktemp()
        log = logging.getLogger("ray.serve")
        log.addHandler(logging.handlers.MemoryHandler(1, target=logging.FileHandler(path)))
        log.setLevel(logging.INFO)
        log.info("before")
        from kvtransfer.backends.nixl import _import_nixl
        _import_nixl()
        log.info("after")
        print(open(path).read().split())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().endswith("['before', 'after']")


def test_an_nccl_push_to_a_peer_that_does_not_answer_never_blocks_its_caller():
    """The sender's join is a rendezvous that waits for the peer (up to the timeout for one that
    is gone); its caller, the engine thread, must not wait with it: ``push`` returns at once,
    the transfer fails once the join has, and the link is forgotten (the next push joins
    again)."""
    import socket
    from dataclasses import replace

    sender = KVEndpoint(torch.zeros(2, 8, 2, 2, 4, 4), LAYOUT, "nccl", timeout_s=1.0)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = replace(sender.info(), endpoint_id="gone",
                   connections=(("nccl", f"127.0.0.1:{port}".encode()),))
    try:
        start = time.monotonic()
        t = sender.push(gone, KVDestination("r", "gone", (1,), 0, time.time() + 30), [2])
        assert time.monotonic() - start < 0.5 and t.state is TransferState.IN_FLIGHT
        assert sender.wait(t, timeout=20) is TransferState.FAILED
        assert "gone" not in sender.backend._links
    finally:
        sender.close()


def test_a_failed_write_forgets_the_peer_but_a_deadline_does_not():
    """A restarted replica is a new endpoint; a write to the old one fails in the transport and
    the sender drops what it kept of it (a NIXL remote agent, a mapped CUDA cache). A write that
    merely ran out of time keeps the peer."""
    fabric = LocalFabric()
    cache = torch.zeros(2, 8, 2, 2, 4, 4)
    sender = KVEndpoint(cache.clone(), LAYOUT, "local", fabric=fabric)
    forgotten = []
    sender.backend.disconnect = forgotten.append
    gone = KVEndpoint(cache.clone(), LAYOUT, "local", fabric=fabric)
    peer = gone.info()
    gone.close()  # the receiver's process is gone
    t = sender.push(peer, KVDestination("r1", peer.endpoint_id, (1,), 0, time.time() + 5), [2])
    assert t.state is TransferState.FAILED and forgotten == [peer.endpoint_id]
    late = KVEndpoint(cache.clone(), LAYOUT, "local", fabric=fabric)
    t = sender.push(late.info(), KVDestination("r2", late.endpoint_id, (1,), 0, time.time() - 1),
                    [2])
    assert t.state is TransferState.FAILED and "deadline" in t.error
    assert forgotten == [peer.endpoint_id]


def _replica(fabric: LocalFabric, ranks: int, name: str):
    """A replica endpoint of ``ranks`` ranks over LAYOUT's 2 KV heads (random caches)."""
    from dataclasses import replace

    from kvtransfer import ReplicaEndpoint

    eps = []
    for rank in range(ranks):
        layout = replace(LAYOUT, tp_size=ranks, tp_rank=rank)
        cache = torch.randn(8, LAYOUT.num_layers, 2, layout.local_kv_heads, LAYOUT.block_size,
                            LAYOUT.head_dim).transpose(0, 1)
        eps.append(KVEndpoint(cache, layout, "local", endpoint_id=f"{name}.{rank}",
                              fabric=fabric))
    return ReplicaEndpoint(eps)


def test_a_split_replica_counts_its_leased_blocks_once_and_lands_only_whole():
    """Both ranks lease the same block ids: the replica holds 3 blocks, not 6; a push from one
    rank to two writes each receiver rank its head, and the lease lands once both have."""
    fabric = LocalFabric()
    sender, receiver = _replica(fabric, 1, "p"), _replica(fabric, 2, "d")
    dest = KVDestination("r", receiver.endpoint_id, (1, 2, 3), 0, time.time() + 10)
    landed = []
    t = receiver.expect(dest, landed.append)
    assert receiver.held_blocks == 3 and not t.state.is_terminal
    pushed = sender.push(receiver.info(), dest, [4, 5, 6])
    assert pushed.state is TransferState.DONE and pushed.stats.bytes == 3 * LAYOUT.block_bytes
    receiver.poll()
    assert landed == [t] and t.state is TransferState.DONE and receiver.held_blocks == 0
    for rank, ep in enumerate(receiver.ranks):  # each rank holds its head of the sent blocks
        assert torch.equal(ep.kv_cache[:, [1, 2, 3]],
                           sender.kv_cache[:, [4, 5, 6], :, rank:rank + 1])


@pytest.mark.parametrize("on_gpu", [False, True], ids=["dram", "vram"])
def test_nixl_backend_sets_its_ucx_defaults_before_ucx_loads(monkeypatch, on_gpu):
    """On a GPU, UCX's memory-type cache is off (it takes a CUDA mapping opened after UCX
    started for host memory, and registering such a cache fails); on CPU, shared memory. Both
    are set before NIXL (and with it UCX) is imported, and a user's own setting is kept."""
    import kvtransfer.backends.nixl as nixl_backend

    for var in ("UCX_MEMTYPE_CACHE", "UCX_TLS"):
        monkeypatch.delenv(var, raising=False)
    seen = {}

    class Agent:
        def __init__(self, *args, **kwargs):
            pass

        def create_backend(self, name, params):
            seen["params"] = params

        def register_memory(self, regions, mem_type):
            seen["mem_type"] = mem_type

    def fake_import():
        seen["env"] = {v: os.environ.get(v) for v in ("UCX_MEMTYPE_CACHE", "UCX_TLS")}
        return Agent, lambda **kw: kw

    monkeypatch.setattr(nixl_backend, "_import_nixl", fake_import)
    cache = torch.zeros(2, 4, 8)
    if on_gpu:  # a CPU tensor that says it is on a GPU is all the constructor looks at
        cache = type("CudaLike", (), {"is_cuda": True, "device": torch.device("cpu"),
                                      "numel": cache.numel, "element_size": cache.element_size,
                                      "data_ptr": cache.data_ptr})()
    nixl_backend.NixlBackend("ep", cache, layout=None)
    assert seen["env"] == ({"UCX_MEMTYPE_CACHE": "n", "UCX_TLS": None} if on_gpu else
                           {"UCX_MEMTYPE_CACHE": None, "UCX_TLS": "sm,self"})
    assert seen["mem_type"] == ("VRAM" if on_gpu else "DRAM")
    monkeypatch.setenv("UCX_MEMTYPE_CACHE", "y")  # the user's own setting wins
    nixl_backend.NixlBackend("ep2", cache, layout=None)
    assert seen["env"]["UCX_MEMTYPE_CACHE"] == "y"
