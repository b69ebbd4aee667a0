"""The decode side's hand-over state machine (``decode_worker.handover``), every path, against a
stand-in engine and KV endpoint: landed before or after the answer (with and without the
transport's own notification), a failed push, the deadline, the prefill replica gone, and an
abort in every state, on one-sided and receiver-writes transports. Each path ends exactly once,
with the engine's blocks either admitted or released, and the event loop's future resolved."""

import asyncio
import time

import pytest

from contracts.messages import PrefillResult
from decode_worker.handover import HandOvers, State
from engine.errors import BadRequest
from engine.outputs import RequestOutput
from kvtransfer import TransferState, TransferStats
from kvtransfer.endpoint import Transfer


class Engine:
    """What the machine asks of the engine: reserve, admit, abort."""

    def __init__(self, room: bool = True):
        self.room = room
        self.admitted: list[tuple[str, int]] = []
        self.aborted: list[str] = []
        self.set_aside_as: list[tuple[str, str]] = []
        self.released: list[str] = []
        self.vocab_size = 1000

    def reserve(self, prompt, params, rid):
        return (rid, [5, 6, 7], 16) if self.room else None

    def admit(self, rid, token, logprob=None, top=None):
        if not 0 <= token < self.vocab_size:  # as the engine checks a peer's token
            raise BadRequest(f"token id {token} is outside the vocabulary")
        self.admitted.append((rid, token))
        return RequestOutput(rid, [token])

    def abort_request(self, rid):
        self.aborted.append(rid)

    def set_aside(self, rid, key):  # aborted, its blocks held under ``key``
        self.set_aside_as.append((rid, key))

    def release_held_blocks(self, key):
        self.released.append(key)


class Endpoint:
    """A receiving KV endpoint: leases end by ``land`` (notification), ``mark_landed`` (the
    answer's word), ``expire`` (deadline) or ``abort``."""

    endpoint_id = "decode-0"

    def __init__(self, notify: bool = True, receiver_writes: bool = False):
        self.notify, self.receiver_writes = notify, receiver_writes
        self.leases: dict[str, Transfer] = {}

    def expect(self, dest, on_finish):
        t = Transfer(dest.transfer_id, "recv", "", tuple(dest.block_ids), dest.deadline,
                     TransferStats(), on_finish)
        t.update(TransferState.IN_FLIGHT)
        self.leases[dest.transfer_id] = t
        return t

    def native_notify(self, backend):
        return self.notify

    def land(self, tid):
        self.leases[tid].update(TransferState.DONE)

    mark_landed = land

    def expire(self, tid):
        self.leases[tid].update(TransferState.FAILED, "deadline passed")

    def abort(self, tid, reason="aborted"):
        self.leases[tid].update(TransferState.FAILED, reason)


def answer(rid: str, token: int = 42) -> PrefillResult:
    return PrefillResult(request_id=rid, first_token=token, first_logprob=None,
                         num_prompt_tokens=40, num_cached_tokens=0,
                         stats=TransferStats(backend="nixl"), prefill_seconds=0.01)


def run(scenario, notify=True, receiver_writes=False, room=True):
    """``scenario(machine, engine, endpoint, handover)`` on a fresh machine, inside a loop."""
    engine, endpoint = Engine(room), Endpoint(notify, receiver_writes)
    published = []
    machine = HandOvers(endpoint, published.extend)

    async def main():
        h = machine.reserve(engine, [1] * 40, None, "r", 1e12, asyncio.get_running_loop())
        if h is None:
            return None
        assert h.state is State.LEASED and machine.get("r") is h
        result = scenario(machine, engine, endpoint, h)
        if h.state.is_terminal:
            assert await asyncio.wait_for(h.outcome, 1) is h
            assert machine.get("r") is None  # ended once, and forgotten
        return result

    return asyncio.run(main()), engine, endpoint, published


def test_no_room_reserves_nothing():
    result, engine, endpoint, _ = run(lambda *a: None, room=False)
    assert result is None and not endpoint.leases and not engine.aborted


@pytest.mark.parametrize("order", ["landed-then-answered", "answered-then-landed"])
def test_landed_and_answered_in_either_order_admit_once(order):
    """The transport's notification may come first (landed, then admitted on the answer); the
    answer, the sender's word that its push ended DONE, lands and admits by itself, and a
    notification after it changes nothing."""
    def scenario(machine, engine, endpoint, h):
        steps = [lambda: endpoint.land(h.dest.transfer_id),
                 lambda: machine.answered(engine, "r", answer("r"))]
        if order == "answered-then-landed":
            steps.reverse()
        steps[0]()
        assert h.state is (State.LANDED if order == "landed-then-answered" else State.ADMITTED)
        steps[1]()
        assert h.state is State.ADMITTED

    _, engine, _, published = run(scenario)
    assert engine.admitted == [("r", 42)] and not engine.aborted
    assert [o.new_token_ids for o in published] == [[42]]  # the first token, published once


@pytest.mark.parametrize("receiver_writes", [False, True], ids=["one-sided", "receiver-writes"])
@pytest.mark.parametrize("order", ["landed-then-answered", "answered-then-landed"])
def test_an_answer_the_engine_refuses_releases_the_blocks(order, receiver_writes):
    """A prefill replica's answer whose first token the engine refuses (outside the vocabulary):
    released like a failed push (the request is then prefilled here), never left leased, and
    nothing raised into the transport's callback or the engine's ticker."""
    def scenario(machine, engine, endpoint, h):
        steps = [lambda: endpoint.land(h.dest.transfer_id),
                 lambda: machine.answered(engine, "r", answer("r", token=10**6))]
        if order == "answered-then-landed":
            steps.reverse()
        for step in steps:
            if not h.state.is_terminal:
                step()
        assert h.state is State.RELEASED and "refused" in h.reason

    _, engine, _, published = run(scenario, receiver_writes=receiver_writes)
    assert engine.aborted == ["r"] and not engine.admitted and not published


def test_a_transport_without_notifications_lands_on_the_answer():  # (CUDA IPC's case)
    def scenario(machine, engine, endpoint, h):
        machine.answered(engine, "r", answer("r"))  # mark_landed, then admitted at once
        assert h.state is State.ADMITTED

    _, engine, _, _ = run(scenario, notify=False)
    assert engine.admitted == [("r", 42)]


@pytest.mark.parametrize("how", ["push failed", "replica gone"])
def test_a_lease_that_ends_without_the_kv_releases_the_blocks(how):
    def scenario(machine, engine, endpoint, h):
        # the call raised: a failed push, or a dead replica; nothing can write any more
        machine.call_ended(engine, "r", how)
        assert h.state is State.RELEASED and h.fence is None
        machine.answered(engine, "r", answer("r"))  # a late answer changes nothing
        machine.call_ended(engine, "r", "again")

    _, engine, _, published = run(scenario)
    assert engine.aborted == ["r"] and not engine.admitted and not published


@pytest.mark.parametrize("ends", ["call ends", "longest drain passes", "receiver writes"])
def test_a_lease_past_its_deadline_while_its_call_runs_is_fenced(ends, monkeypatch):
    """The deadline passed with the prefill call still running. One-sided, a write in flight at
    the sender's deadline runs to its end (the sender answers only then): the request is let go
    (its id free for a local prefill) but its blocks are set aside until the call ends
    (``unfence``) or, at the latest, the longest a sender keeps a write past its deadline has
    passed (``expire_fences``, an engine ticker). A receiver that copies the data itself has
    stopped: released at once."""
    import kvtransfer.endpoint as kv_endpoint

    def scenario(machine, engine, endpoint, h):
        if ends == "longest drain passes":
            monkeypatch.setattr(kv_endpoint, "DRAIN_MAX_S", 0.0)
            monkeypatch.setattr(kv_endpoint, "RECV_GRACE_S", 0.05)
        endpoint.expire(h.dest.transfer_id)
        assert h.state is State.RELEASED and machine.get("r") is None
        machine.answered(engine, "r", answer("r"))  # a late answer changes nothing
        if ends == "receiver writes":
            return h
        assert engine.set_aside_as == [("r", h.fence)] and machine.num_fenced_blocks == 3
        machine.expire_fences(engine)
        assert not engine.released  # not yet
        if ends == "call ends":
            machine.unfence(engine, h)
        else:
            time.sleep(0.06)
            machine.expire_fences(engine)
        machine.unfence(engine, h)  # harmless twice
        assert engine.released == [h.fence] and machine.num_fenced_blocks == 0
        return h

    h, engine, _, published = run(scenario, receiver_writes=ends == "receiver writes")
    assert not engine.admitted and not published
    assert engine.aborted == (["r"] if ends == "receiver writes" else [])
    assert (h.fence is None) == (ends == "receiver writes")


def test_the_prefill_replica_gone_after_the_kv_landed_releases_too():
    def scenario(machine, engine, endpoint, h):
        endpoint.land(h.dest.transfer_id)
        machine.call_ended(engine, "r", "replica gone")  # no first token will come
        assert h.state is State.RELEASED and h.reason == "replica gone"

    _, engine, _, _ = run(scenario)
    assert engine.aborted == ["r"] and not engine.admitted


@pytest.mark.parametrize("receiver_writes", [False, True])
def test_abandoned_while_the_call_writes(receiver_writes):
    """One-sided: fenced until the call ends (its push is over); a transport whose receiver
    copies the data itself: released at once."""
    def scenario(machine, engine, endpoint, h):
        machine.abandon(engine, "r", call_running=True)
        if receiver_writes:
            assert h.state is State.RELEASED
            return
        assert h.state is State.LEASED and not engine.aborted  # fenced
        endpoint.land(h.dest.transfer_id)  # its write landed after all: still not admitted
        assert h.state is State.RELEASED

    _, engine, _, published = run(scenario, receiver_writes=receiver_writes)
    assert engine.aborted == ["r"] and not engine.admitted and not published


@pytest.mark.parametrize("end", ["answered", "call ended", "deadline"])
def test_a_fenced_lease_ends_with_its_call_or_its_deadline(end):
    """Abandoned while its call writes: released when the call answers or ends; at the
    deadline with the call still running, its blocks are set aside until the call ends."""
    def scenario(machine, engine, endpoint, h):
        machine.abandon(engine, "r", call_running=True)
        if end == "answered":
            machine.answered(engine, "r", answer("r"))
        elif end == "call ended":
            machine.call_ended(engine, "r", "request aborted; its prefill has answered")
        else:
            endpoint.expire(h.dest.transfer_id)
        assert h.state is State.RELEASED

    _, engine, _, published = run(scenario)
    assert not engine.admitted and not published
    if end == "deadline":
        assert not engine.aborted and [rid for rid, _ in engine.set_aside_as] == ["r"]
    else:
        assert engine.aborted == ["r"] and not engine.set_aside_as


@pytest.mark.parametrize("state", ["leased, no call", "landed", "admitted"])
def test_abandoned_elsewhere_is_released_or_aborted_at_once_and_harmless_twice(state):
    def scenario(machine, engine, endpoint, h):
        if state != "leased, no call":
            endpoint.land(h.dest.transfer_id)
        if state == "admitted":
            machine.answered(engine, "r", answer("r"))
        machine.abandon(engine, "r", call_running=False)
        machine.abandon(engine, "r", call_running=False)
        assert h.state is (State.ADMITTED if state == "admitted" else State.RELEASED)

    _, engine, _, _ = run(scenario)
    # released: its blocks freed once, then the second abandon finds nothing but the engine's
    # own (finished) request; admitted: the running request aborted, twice harmlessly
    assert engine.aborted == ["r", "r"]
    assert engine.admitted == ([("r", 42)] if state == "admitted" else [])


def test_one_request_id_at_a_time():
    def scenario(machine, engine, endpoint, h):
        with pytest.raises(ValueError, match="already in use"):
            machine.reserve(engine, [1] * 40, None, "r", 1e12, asyncio.get_running_loop())

    run(scenario)
