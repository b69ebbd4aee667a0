"""The token channel: one TCP connection per (decode replica, ingress replica) pair that carries,
per engine step, one frame holding every new token of that ingress's requests. Serving costs
O(engine steps) messages this way, not O(streams × tokens) as one Serve item per token would.
The same kind of connection joins a prefill replica (publisher) to each decode replica's own
sink: a hand-over's first token and answer one way, hand-overs sent ahead the other
(``decode_worker.server``, ``prefill_worker.server``).

Lifecycle: an ingress replica runs a :class:`TokenSink` and names it (``StreamAddress``) in each
request → the decode replica's :class:`TokenPublisher` dials the sink once and says hello with
the sink's key → :meth:`TokenPublisher.route` ties a request to that connection → after each
engine step :meth:`TokenPublisher.publish` (engine thread) packs one frame per sink → the event
loop writes it → the sink hands each delta to its request's handler. A request's route ends
with its last delta (its ``done`` future resolves) or with :meth:`TokenPublisher.unroute`; a
connection that drops fails the ``done`` future of every request routed over it. Once the
request has ended, :meth:`TokenPublisher.end` sends its result (a dict: usage, timings, or the
refusal of a bad request) on the same connection, behind its last delta; the sink hands it to
the request's ``on_end``. A sink whose connection drops tells ``on_lost`` of every request that
had frames on it.

Frames: a 4-byte big-endian length, then msgpack. The first is the publisher's hello
``[PROTOCOL, key, publisher_id]``; then ``[produced_at, [[request_id, token_ids, logprobs,
finish_reason, stop_reason, num_output_tokens, num_cached_tokens, top_logprobs,
prompt_logprobs], ...]]`` (``top_logprobs``: per token, ``[[id, logprob], ...]``, or nil;
``prompt_logprobs``: nil but in a first delta that asked for them), ``produced_at``
being the ``time.time()`` at which the engine step's tokens were known; an end frame is
``[produced_at, [], [[request_id, result], ...]]``.

Early starts and cancels (the other way, sink to publisher): ``["submit", pickled
GenerateRequest]``, ``["withdraw", request_id]`` and ``["cancel", request_id]``. Just before
the ingress calls a decode replica, its replica choice (``router.replica_choice``) sends the
request over the connection of the replica it ranks first, where the call then goes
(:meth:`TokenSink.submit`), so the engine starts on it while the call travels; the publisher
holds everything such a request publishes (:meth:`TokenPublisher.route` with ``held``) until the
Serve call for it arrives and claims it (:meth:`TokenPublisher.claim`), or drops it
(:meth:`TokenPublisher.drop`: the call went to another replica, or never came). The Serve call
stays the request's one authority (its replica, its failure, the counts autoscaling reads); the
early start only moves the engine's work ahead of it. Its cancellation goes both ways: Serve's
cancel of the call is best effort (dropped when it comes while the call is being handed to a
replica, the moment an early start's claim sends its held tokens), so the ingress also says
``cancel`` on the channel (:meth:`TokenSink.cancel`), and the replica stops the request however
it started. A publisher's id is its Serve replica's id, which the replica choice knows the
replica by.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import struct
import time
import uuid
import weakref
from collections.abc import Callable, Iterable

import msgpack

from contracts.messages import StreamAddress, TokenDelta
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
PROTOCOL = 4
HELLO_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = 64 << 20
_LEN = struct.Struct(">I")

DeltaHandler = Callable[[TokenDelta, float], None]
EndHandler = Callable[[dict], None]
LostHandler = Callable[[], None]
# Sinks that take early starts (``TokenSink(early_start=True)``), by sink id: the replica
# choice of the same process finds a request's sink here from its ``reply_to``.
_EARLY_SINKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# This process's replica choice of each deployment (``router.replica_choice.KVAwareRouter``), by
# the deployment's name: the ingress asks it to start a request early. (Here, not in the
# router's module: Serve pickles the router class by value, with the globals it names.)
_EARLY_ROUTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def early_sink(address: StreamAddress | None) -> TokenSink | None:
    """The sink at ``address`` if it lives in this process and takes early starts."""
    return _EARLY_SINKS.get(address.sink_id) if address is not None else None


def register_early_router(deployment_name: str, router) -> None:
    _EARLY_ROUTERS[deployment_name] = router


def early_router(deployment_name: str | None):
    """This process's replica choice of the deployment (None until Serve has made it)."""
    return _EARLY_ROUTERS.get(deployment_name) if deployment_name else None


class TokenChannelLost(ConnectionError):
    """The connection that carried a request's tokens closed before the request ended."""


def _frame(obj) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(payload)) + payload


def encode_step(produced_at: float, outputs: Iterable[RequestOutput]) -> bytes:
    return _frame([produced_at, [[o.request_id, o.new_token_ids, o.new_logprobs, o.finish_reason,
                                  o.stop_reason, o.num_output_tokens, o.num_cached_tokens,
                                  o.new_top_logprobs, o.prompt_logprobs]
                                 for o in outputs]])


def encode_end(request_id: str, result: dict) -> bytes:
    return _frame([time.time(), [], [[request_id, result]]])


def decode_step(payload: bytes) -> tuple[float, list[TokenDelta], list]:
    """``(produced_at, deltas, ends)``; ``ends``: ``[request_id, result]`` pairs."""
    produced_at, rows, *rest = msgpack.unpackb(payload, raw=False)
    return produced_at, [TokenDelta(*row) for row in rows], rest[0] if rest else []


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"token frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    return await reader.readexactly(size)


class TokenSink:
    """The ingress side: accepts publishers and hands each delta to its request's handler (on
    the event loop that started the sink)."""

    def __init__(self, host: str = "127.0.0.1", early_start: bool = False):
        """``early_start``: requests may be sent ahead of their Serve calls (:meth:`submit`)."""
        self.host = host
        self.key = secrets.token_hex(16)
        self.sink_id = uuid.uuid4().hex
        self.address: StreamAddress | None = None
        self.early_start = early_start
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publishers: dict[str, asyncio.StreamWriter] = {}  # publisher id -> its connection
        self._handlers: dict[str, DeltaHandler] = {}
        self._on_end: dict[str, EndHandler] = {}
        self._on_lost: dict[str, LostHandler] = {}
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._seen: dict[asyncio.StreamWriter, set[str]] = {}  # by connection
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self.num_frames = 0

    async def start(self) -> StreamAddress:
        async with self._lock:
            if self._server is None or self._loop is not asyncio.get_running_loop():
                self._server = await asyncio.start_server(self._serve, self.host, 0)
                self._loop = asyncio.get_running_loop()
                port = self._server.sockets[0].getsockname()[1]
                self.address = StreamAddress(self.host, port, self.key, self.sink_id)
                if self.early_start:
                    _EARLY_SINKS[self.sink_id] = self
        return self.address

    def submit(self, publisher_id: str, request) -> bool:
        """Send ``request`` (a ``GenerateRequest`` naming this sink) to the publisher
        ``publisher_id`` ahead of its Serve call, if that publisher is connected (any thread);
        whether it was sent."""
        return self._send(publisher_id, ["submit", pickle.dumps(request)])

    def withdraw(self, publisher_id: str, request_id: str) -> None:
        """Take back an early start whose Serve call went elsewhere (any thread)."""
        self._send(publisher_id, ["withdraw", request_id])

    def cancel(self, request_id: str) -> None:
        """Stop ``request_id`` on its publisher, beside its Serve call's cancel (which Serve
        drops when it comes while the call is being handed to a replica): sent on the
        connection that carried its frames, or on every connection if none has yet (its
        early start, or its call, may be on the way to any of them). Event loop."""
        carriers = [w for w, seen in self._seen.items() if request_id in seen]
        data = _frame(["cancel", request_id])
        for writer in carriers or list(self._publishers.values()):
            if not writer.is_closing():
                writer.write(data)

    def _send(self, publisher_id: str, message: list) -> bool:
        writer = self._publishers.get(publisher_id)
        if writer is None or writer.is_closing() or self._loop is None:
            return False
        data = _frame(message)
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            writer.write(data)
        else:
            self._loop.call_soon_threadsafe(_write, writer, data)
        return True

    def register(self, request_id: str, handler: DeltaHandler, on_end: EndHandler | None = None,
                 on_lost: LostHandler | None = None) -> None:
        self._handlers[request_id] = handler
        if on_end is not None:
            self._on_end[request_id] = on_end
        if on_lost is not None:
            self._on_lost[request_id] = on_lost

    def unregister(self, request_id: str) -> None:
        self._handlers.pop(request_id, None)
        self._on_end.pop(request_id, None)
        self._on_lost.pop(request_id, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._writers.add(writer)
        self._tasks.add(asyncio.current_task())
        seen: set[str] = set()  # requests with frames on this connection
        self._seen[writer] = seen
        try:
            hello = msgpack.unpackb(await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S))
            if not (isinstance(hello, list) and len(hello) == 3 and hello[0] == PROTOCOL
                    and secrets.compare_digest(str(hello[1]), self.key)):
                log.warning("token sink: refused a publisher from %s (bad hello)", peer)
                return
            publisher_id = str(hello[2])
            self._publishers[publisher_id] = writer
            while True:
                produced_at, deltas, ends = decode_step(await _read_frame(reader))
                self.num_frames += 1
                for delta in deltas:
                    handler = self._handlers.get(delta.request_id)
                    if handler is not None:
                        seen.add(delta.request_id)
                        handler(delta, produced_at)
                if len(seen) > 2 * len(self._handlers) + 64:  # requests that ended with no end
                    seen.intersection_update(self._handlers)  # frame (cancelled): forgotten
                for rid, result in ends:
                    seen.discard(rid)
                    on_end = self._on_end.get(rid)
                    if on_end is not None:
                        on_end(result)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the publisher went away: its requests learn it below or by their calls
        except Exception:  # noqa: BLE001 - a malformed frame ends that connection only
            log.exception("token sink: dropped the connection from %s", peer)
        finally:
            self._writers.discard(writer)
            self._seen.pop(writer, None)
            self._publishers = {k: w for k, w in self._publishers.items() if w is not writer}
            self._tasks.discard(asyncio.current_task())
            writer.close()
            for rid in seen:
                on_lost = self._on_lost.get(rid)
                if on_lost is not None:
                    on_lost()

    async def close(self) -> None:
        """Stop listening and drop every publisher (their requests fail on their side). The
        connections' tasks end by themselves once their transports close; they are awaited
        (bounded), so none is left to be cancelled when the loop stops (asyncio of Python 3.11
        then prints a spurious CancelledError traceback)."""
        _EARLY_SINKS.pop(self.sink_id, None)
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        if self._server is not None:
            await self._server.wait_closed()

    def close_soon(self) -> None:
        """:meth:`close` from any thread, on the sink's loop (if it was started and runs)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.close()))
            except RuntimeError:  # closed meanwhile: its sockets went with it
                pass


class _Connection:
    def __init__(self, address: StreamAddress, writer: asyncio.StreamWriter,
                 loop: asyncio.AbstractEventLoop):
        self.address = address
        self.writer = writer
        self.loop = loop
        self.alive = True
        self.routes: set[str] = set()


class _Route:
    """A request routed over a connection: ``done`` gets its last output; ``first_at`` is when
    its first tokens were published (or made, while ``held``)."""

    __slots__ = ("conn", "done", "first_at", "held")

    def __init__(self, conn: _Connection, done: asyncio.Future, held: bool = False):
        self.conn = conn
        self.done = done
        self.first_at = 0.0
        self.held = held  # started early: its frames wait for its Serve call (claim)


class TokenPublisher:
    """The decode side: sends each request's engine outputs to the sink that asked for them.
    ``connect``/``route``/``unroute`` run on the event loop (one loop: the replica's, where every
    connection lives), ``publish`` on the engine thread, ``fail_all`` on any thread."""

    def __init__(self, publisher_id: str | None = None):
        """``publisher_id``: its Serve replica's id (a fresh one outside Serve)."""
        self.publisher_id = publisher_id or uuid.uuid4().hex
        self._conns: dict[str, _Connection] = {}
        self._dialing: dict[str, asyncio.Future] = {}
        self._routes: dict[str, _Route] = {}
        # Early starts' routes and frames until their Serve calls claim them (event loop only).
        self._held: dict[str, tuple[_Route, list[bytes]]] = {}
        # Called on the event loop with (connection, GenerateRequest) / (request id).
        self.on_submit: Callable[[_Connection, object], None] | None = None
        self.on_withdraw: Callable[[str], None] | None = None
        self.on_cancel: Callable[[_Connection, str], None] | None = None

    @property
    def num_routes(self) -> int:
        return len(self._routes)

    async def connect(self, address: StreamAddress, timeout_s: float = 10.0) -> _Connection:
        """The live connection to ``address``, dialled once and shared by its requests."""
        conn = self._live(address)
        if conn is not None:
            return conn
        dialing = self._dialing.get(address.sink_id)
        if dialing is None or dialing.get_loop() is not asyncio.get_running_loop():
            dialing = asyncio.ensure_future(self._dial(address, timeout_s))
            self._dialing[address.sink_id] = dialing
            dialing.add_done_callback(lambda _f: self._dialing.pop(address.sink_id, None))
        return await asyncio.shield(dialing)

    def connection(self, address: StreamAddress) -> _Connection | None:
        """The live connection to ``address`` if there is one; if not, it is dialled in the
        background for the next request (event loop), and None: this one does without."""
        conn = self._live(address)
        if conn is None and address.sink_id not in self._dialing:
            asyncio.ensure_future(self.connect(address)).add_done_callback(_dialled)
        return conn

    def _live(self, address: StreamAddress) -> _Connection | None:
        conn = self._conns.get(address.sink_id)  # one on another loop (tests run several) is not
        if conn is not None and conn.alive and conn.loop is asyncio.get_running_loop():
            return conn
        return None

    async def _dial(self, address: StreamAddress, timeout_s: float) -> _Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), timeout_s)
        writer.write(_frame([PROTOCOL, address.key, self.publisher_id]))
        conn = _Connection(address, writer, asyncio.get_running_loop())
        self._conns[address.sink_id] = conn
        asyncio.ensure_future(self._watch(conn, reader))
        return conn

    async def _watch(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        """The sink's early starts and withdrawals; EOF (or an error) means the connection is
        gone."""
        try:
            while True:
                kind, body = msgpack.unpackb(await _read_frame(reader), raw=False)
                handler = {"submit": self.on_submit, "withdraw": self.on_withdraw,
                           "cancel": self.on_cancel}.get(kind)
                if handler is None:
                    continue
                try:
                    if kind == "submit":
                        handler(conn, pickle.loads(body))
                    elif kind == "cancel":
                        handler(conn, body)
                    else:
                        handler(body)
                except Exception:  # noqa: BLE001 - its Serve call will start it as usual
                    log.exception("token channel: an early %s failed", kind)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # noqa: BLE001 - a malformed frame ends the connection
            log.exception("token channel: dropped the connection to %s:%s", conn.address.host,
                          conn.address.port)
        conn.alive = False
        if self._conns.get(conn.address.sink_id) is conn:
            del self._conns[conn.address.sink_id]
        lost = TokenChannelLost(f"token channel to {conn.address.host}:{conn.address.port} "
                                "closed")
        for rid in list(conn.routes):
            route = self._routes.pop(rid, None)
            if route is not None and not route.done.done():
                route.done.set_exception(lost)
        conn.routes.clear()
        conn.writer.close()

    def route(self, request_id: str, conn: _Connection, held: bool = False) -> _Route:
        """Send ``request_id``'s outputs over ``conn``; ``route.done`` gets its last output.
        ``held`` (an early start, event loop): keep its frames, and its end, until
        :meth:`claim` sends them or :meth:`drop` forgets them."""
        if not conn.alive:
            raise TokenChannelLost(f"token channel to {conn.address.host}:{conn.address.port} "
                                   "closed")
        if request_id in self._routes or request_id in self._held:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        route = self._routes[request_id] = _Route(conn, conn.loop.create_future(), held)
        conn.routes.add(request_id)
        if held:
            self._held[request_id] = (route, [])
        return route

    def claim(self, request_id: str) -> None:
        """An early start's Serve call has come: send what it held, in order, and what it
        publishes from now on at once (event loop)."""
        route, frames = self._held.pop(request_id, (None, ()))
        if route is None:
            return
        route.held = False
        for data in frames:
            if route.conn.alive:
                route.conn.writer.write(data)

    def drop(self, request_id: str) -> None:
        """Forget an early start that was never claimed: nothing it held or makes later is sent
        (event loop)."""
        self._held.pop(request_id, None)
        self.unroute(request_id)

    def unroute(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            route.conn.routes.discard(request_id)

    def publish(self, outputs: list[RequestOutput], produced_at: float | None = None) -> None:
        """Pack the outputs of one engine step into one frame per connection (engine thread)."""
        at = time.time() if produced_at is None else produced_at
        by_conn: dict[_Connection, list[RequestOutput]] = {}
        held: list[tuple[_Route, str, bytes]] = []  # early starts' own frames
        finished: list[tuple[_Route, RequestOutput]] = []
        loop = None
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            loop = route.conn.loop
            if route.held:  # claimed meanwhile: _flush sends it at once
                held.append((route, out.request_id, encode_step(at, [out])))
            else:
                by_conn.setdefault(route.conn, []).append(out)
            if not route.first_at and out.new_token_ids:
                route.first_at = at
            if out.finished:
                finished.append((route, out))
        if loop is None:
            return
        frames = [(conn, encode_step(at, outs)) for conn, outs in by_conn.items()]
        try:
            loop.call_soon_threadsafe(self._flush, frames, finished, held)
        except RuntimeError:  # that loop has closed: nobody is left to send to
            log.warning("token channel: outputs for a closed event loop dropped")

    def _flush(self, frames: list[tuple[_Connection, bytes]],
               finished: list[tuple[_Route, RequestOutput]],
               held: list[tuple[_Route, str, bytes]] = ()) -> None:
        for conn, data in frames:
            if conn.alive:
                conn.writer.write(data)
        for route, rid, data in held:
            self._send_or_hold(route, rid, data)
        for route, out in finished:
            if self._routes.get(out.request_id) is route:
                del self._routes[out.request_id]
                route.conn.routes.discard(out.request_id)
            if not route.done.done():
                route.done.set_result(out)

    def end(self, route: _Route, request_id: str, result: dict) -> None:
        """Send a request's result behind its last delta (event loop; after ``route.done``)."""
        self._send_or_hold(route, request_id, encode_end(request_id, result))

    def _send_or_hold(self, route: _Route, request_id: str, data: bytes) -> None:
        if route.held:  # not claimed yet, or dropped: then nothing of it is sent
            held = self._held.get(request_id)
            if held is not None and held[0] is route:
                held[1].append(data)
        elif route.conn.alive:
            route.conn.writer.write(data)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every routed request (any thread): the engine behind them is gone."""
        for route in list(self._routes.values()):
            route.conn.loop.call_soon_threadsafe(_fail, route.done, exc)

    async def close(self) -> None:
        for conn in list(self._conns.values()):
            conn.writer.close()
        self._conns.clear()


def _dialled(dial: asyncio.Future) -> None:
    if not dial.cancelled() and (exc := dial.exception()) is not None:
        log.warning("token channel: could not dial a sink in the background: %r", exc)


def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(data)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
