"""A request's hand-over on the decode side: one state machine, advanced on the engine thread.

The states only move forward (as vLLM v1's ``WAITING_FOR_REMOTE_KVS`` is one status of the
request, owned by its scheduler):

- ``LEASED``: blocks for the part of the prompt the local prefix cache lacks are reserved in the
  engine (``Scheduler.transferring``) and leased to the KV endpoint until a deadline; the
  prefill call is under way.
- ``LANDED``: every byte has landed (the transport's notification, or the prefill replica's
  answer where the transport has none); the answer is still to come.
- ``ADMITTED`` (terminal): the request joined the running batch with the prefill replica's first
  token, which is published at once unless it came ahead of the KV (:meth:`HandOvers.first_token`:
  published then, in ``LEASED`` or ``LANDED``).
- ``RELEASED`` (terminal): the lease ended without admission (the deadline passed, the push
  failed, the prefill replica could not deliver, or the request was abandoned) and the reserved
  blocks are free again.

Events, every one on the engine thread: the lease's end (the endpoint's ``on_finish``, from its
poll: a transport's notification can land it before the answer), the prefill replica's answer,
on the decode replica's sink or as the call's return, whichever comes first
(:meth:`HandOvers.answered`: the sender's word that its push ended DONE, so it lands the KV
whatever became of the notification; measured on CPU: after a prefill replica died and was
replaced, NIXL's notifications from the new one never arrived and every hand-over ran to its
deadline), the end of a call that delivered nothing (:meth:`HandOvers.call_ended`: nothing can
still write), and abandonment (:meth:`HandOvers.abandon`). The first token, when it comes ahead
of the KV (:meth:`HandOvers.first_token`), moves no state. A hand-over abandoned while a
one-sided push may still write into its blocks keeps them fenced until its call has ended. A
lease that ends (its deadline) while its call may still write is released, the request free to
be prefilled here, but its blocks are set aside until the call ends, at the latest once the
longest a sender keeps a write past its deadline has passed (``kvtransfer.endpoint.DRAIN_MAX_S``).
So a late write never lands in blocks another request has been given.

The event loop holds one future per hand-over (``HandOver.outcome``), resolved once, with the
hand-over itself, when it reaches a terminal state.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections.abc import Callable

from contracts.messages import PrefillResult
from engine.async_engine import set_result_once
from engine.errors import RequestIdInUse
from engine.outputs import RequestOutput
from kvtransfer import KVDestination, Transfer, TransferState
from kvtransfer import endpoint as kv_endpoint


class State(enum.IntEnum):
    LEASED = 0
    LANDED = 1
    ADMITTED = 2
    RELEASED = 3

    @property
    def is_terminal(self) -> bool:
        return self >= State.ADMITTED


class HandOver:
    """One request's hand-over. Every field but ``outcome`` is the engine thread's."""

    __slots__ = ("request_id", "dest", "state", "transfer", "answer", "abandoned", "reason",
                 "call_over", "fence", "outcome", "_loop")

    def __init__(self, request_id: str, dest: KVDestination, loop: asyncio.AbstractEventLoop):
        self.request_id, self.dest = request_id, dest
        self.state = State.LEASED
        self.transfer: Transfer | None = None  # the lease
        self.answer: PrefillResult | None = None  # the prefill replica's, once it came
        self.abandoned = False
        self.reason: str | None = None  # why it was released
        self.call_over = False  # its prefill call has answered or ended: nothing writes now
        # Released while its call may still write (one-sided): the key its blocks are held
        # under, out of use, until that call ends (:meth:`HandOvers.unfence`).
        self.fence: str | None = None
        self.outcome: asyncio.Future = loop.create_future()
        self._loop = loop

    def _end(self, state: State, reason: str | None = None) -> None:
        self.state, self.reason = state, reason
        self._loop.call_soon_threadsafe(set_result_once, self.outcome, self)


class HandOvers:
    """A decode replica's hand-overs in flight, by request id. Engine thread only: the event
    loop reaches it through engine commands (``AsyncEngine.call``/``submit``)."""

    def __init__(self, endpoint, publish: Callable[[list[RequestOutput]], None]):
        self.endpoint, self.publish = endpoint, publish
        self._live: dict[str, HandOver] = {}
        # First tokens published ahead of their KV, by request id, until admitted (or, where
        # the hand-over was released, taken by the local prefill: :meth:`published_first`).
        self._firsts: dict[str, tuple] = {}
        self._fences = itertools.count()
        self._fenced: dict[str, tuple[float, HandOver]] = {}  # by fence key: (until, hand-over)
        self.closing = False  # the replica stops: nothing is fenced, its cache goes with it

    def get(self, request_id: str) -> HandOver | None:
        return self._live.get(request_id)

    def reserve(self, engine, prompt: list[int], params, request_id: str, deadline: float,
                loop: asyncio.AbstractEventLoop) -> HandOver | None:
        """Reserve the blocks the local prefix cache lacks and lease them until ``deadline``,
        in one command: blocks are never reserved without their lease. None when blocks or
        sequence slots are short right now (nothing is taken)."""
        if request_id in self._live:
            raise RequestIdInUse(f"request_id: {request_id!r} is already in use")
        reserved = engine.reserve(prompt, params, request_id)
        if reserved is None:
            return None
        _, blocks, present = reserved
        dest = KVDestination(request_id=request_id, endpoint_id=self.endpoint.endpoint_id,
                             block_ids=tuple(blocks), num_present_tokens=present,
                             deadline=deadline)
        h = self._live[request_id] = HandOver(request_id, dest, loop)
        h.transfer = self.endpoint.expect(dest, lambda t: self._lease_ended(engine, h, t))
        return h

    def first_token(self, engine, request_id: str, token: int, logprob: float | None,
                    top) -> None:
        """The prefill replica's first token, sent as its step ended, ahead of the push: taken
        and published now unless the request has one, is no longer wanted, or might end with
        it (``engine.take_handed_first_token``); the answer brings it otherwise."""
        h = self._live.get(request_id)
        if h is None or h.state.is_terminal or h.abandoned:
            return
        out = engine.take_handed_first_token(request_id, token, logprob, top)
        if out is not None:
            self._firsts[request_id] = (token, logprob, top)
            self.publish([out])

    def published_first(self, request_id: str) -> tuple | None:
        """The first token a released hand-over published ahead of its KV (its token, logprob
        and top logprobs), for the local prefill to continue from; None if none was."""
        return self._firsts.pop(request_id, None)

    def answered(self, engine, request_id: str, result: PrefillResult) -> None:
        """The prefill replica pushed the KV and sampled the first token."""
        h = self._live.get(request_id)
        if h is None or h.state.is_terminal:
            return
        h.answer, h.call_over = result, True
        if h.abandoned:  # its push is over: nothing can write any more
            self._end_lease(engine, h, "request aborted; its prefill has answered")
        elif h.state is State.LANDED:
            self._admit(engine, h)
        elif not self.endpoint.receiver_writes:  # the sender's word that its push ended DONE
            self.endpoint.mark_landed(h.dest.transfer_id)
        # A transport whose receiver completes the write (NCCL, gloo: a posted receive) lands
        # when that receive has completed, not at the sender's word: admitted then (seen in CI:
        # admitted on the answer, the receive not yet complete, the request decoded stale KV).

    def call_ended(self, engine, request_id: str, reason: str) -> None:
        """The prefill call ended without delivering (refused, its replica gone, its push failed
        or never started, or it was dropped): nothing can still write, the lease ends now."""
        h = self._live.get(request_id)
        if h is None or h.state.is_terminal:
            return
        h.call_over = True
        self._end_lease(engine, h, reason)

    def abandon(self, engine, request_id: str, call_running: bool) -> None:
        """The request is no longer wanted, wherever it is (harmless twice). A hand-over whose
        prefill call is still running (the event loop's word) on a one-sided transport stays
        fenced: released when the call ends (:meth:`call_ended`) or the lease's deadline
        passes. Any other is released now, and a request already admitted is aborted."""
        self._firsts.pop(request_id, None)
        h = self._live.get(request_id)
        if h is None:
            engine.abort_request(request_id)
            return
        h.abandoned, h.call_over = True, h.call_over or not call_running
        if h.state is State.LEASED and call_running and not self.endpoint.receiver_writes:
            return
        self._end_lease(engine, h, "request aborted")

    # -- the lease's end and the two terminal states -----------------------------------------
    def _end_lease(self, engine, h: HandOver, reason: str) -> None:
        """Release now: a lease still running is aborted (its end releases), a landed one has
        nothing left to wait for."""
        if h.state is State.LEASED:
            self.endpoint.abort(h.dest.transfer_id, reason)
        else:
            self._release(engine, h, reason)

    def _lease_ended(self, engine, h: HandOver, t: Transfer) -> None:  # once per lease
        if t.state is not TransferState.DONE and not h.call_over \
                and not self.endpoint.receiver_writes and not self.closing:
            self._fence(engine, h, t.error or "request aborted")
        elif t.state is not TransferState.DONE or h.abandoned:
            self._release(engine, h, t.error or "request aborted")
        elif h.answer is not None:
            self._admit(engine, h)
        else:
            h.state = State.LANDED

    def _admit(self, engine, h: HandOver) -> None:
        r = h.answer
        try:
            out = engine.admit(h.request_id, r.first_token, r.first_logprob,
                               r.first_top_logprobs)
        except Exception as exc:  # noqa: BLE001 - a peer's bad answer (a token outside the
            # vocabulary): released like a push that failed (the request is prefilled here),
            # never left leased nor raised into a transport's callback or the engine's ticker
            self._release(engine, h, f"the prefill replica's answer was refused: {exc}")
            return
        del self._live[h.request_id]
        self._firsts.pop(h.request_id, None)
        h._end(State.ADMITTED)
        if out is not None:  # the first token, before any later step's (unless it came ahead)
            self.publish([out])

    def _release(self, engine, h: HandOver, reason: str) -> None:
        engine.abort_request(h.request_id)  # its reserved blocks go back to the pool
        self._live.pop(h.request_id, None)
        h._end(State.RELEASED, reason)

    def _fence(self, engine, h: HandOver, reason: str) -> None:
        """The lease ended (its deadline) while the prefill call may still write into its
        blocks (a one-sided write in flight at the sender's deadline runs to its end): the
        request is released, its id free for a local prefill at once, but its blocks stay
        out of use until that call ends (:meth:`unfence`)."""
        h.fence = f"fenced/{h.request_id}/{next(self._fences)}"
        engine.set_aside(h.request_id, h.fence)
        # At the latest once the longest a sender keeps a write past its deadline has passed
        # (a frozen prefill replica never answers; its copies ended long before).
        self._fenced[h.fence] = (time.time() + kv_endpoint.late_write_bound_s(), h)
        self._live.pop(h.request_id, None)
        h._end(State.RELEASED, reason)

    def unfence(self, engine, h: HandOver) -> None:
        """A fenced hand-over's call has ended (its write with it): its blocks go back to the
        pool. Harmless twice."""
        if self._fenced.pop(h.fence, None) is not None:
            engine.release_held_blocks(h.fence)

    def expire_fences(self, engine) -> None:
        """Release the fences whose longest wait has passed (an engine ticker)."""
        if self._fenced:
            now = time.time()
            for _, h in [f for f in self._fenced.values() if f[0] <= now]:
                self.unfence(engine, h)

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(h.dest.block_ids) for _, h in list(self._fenced.values()))  # any thread
