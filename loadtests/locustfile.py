"""Locust users for Baton: OpenAI streaming over HTTP (SSE) and gRPC ``GenerateStream``.

    locust -f loadtests/locustfile.py OpenAIStreamUser --host http://127.0.0.1:8000 \
        --model tiny --workload fixed --input-len 128 --output-len 64 --rate 4 --duration 60
    locust -f loadtests/locustfile.py GrpcStreamUser --host 127.0.0.1:9000 ...

Per request it measures TTFT, every inter-token gap, end-to-end latency, output tokens and
errors, and reports them through locust's request events (request type ``HTTP``/``gRPC``, names
``TTFT``, ``ITL``, ``E2E``; E2E carries the output tokens as its response length and the error
as its exception), so the web UI and ``--csv`` show them. With ``--records-file`` each request
is also written as one JSON line (``loadtests.metrics.RequestRecord``), from which the sweep
computes exact percentiles and goodput.

Load: ``--rate R`` is an open loop. Each user sends on a fixed schedule (Poisson or equal gaps,
seeded), every request on its own greenlet, whether or not earlier ones have finished, for
``--duration`` seconds; then it waits up to ``--drain-timeout`` for the answers still streaming
(those that do not finish are errors), and a headless run quits. ``--rate 0`` is a closed loop:
each user sends its next request when its last one ends (``-u`` users; stop with ``--run-time``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import gevent
from gevent.pool import Group
from greenlet import GreenletExit
from locust import User, constant, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

from loadtests import sse, workloads
from loadtests.metrics import RequestRecord


class StreamError(Exception):
    """The server answered with an error (HTTP status, an error event, a gRPC status)."""


@dataclass
class StreamMessage:
    """One message of a stream, whatever the protocol."""

    tokens: int
    finish_reason: str | None = None
    usage: dict | None = None


@events.init_command_line_parser.add_listener
def _arguments(parser):
    add = parser.add_argument
    add("--workload-file", default="", help="JSON lines of LoadRequest (else built from below)")
    add("--model", default="tiny", help="model spec, to choose token-id or text prompts")
    add("--workload", default="fixed", help="fixed | uniform | shared-prefix | multi-turn")
    add("--input-len", type=int, default=128)
    add("--output-len", type=int, default=64)
    add("--num-requests", type=int, default=256, help="requests in the built workload (cycled)")
    add("--seed", type=int, default=0)
    add("--rate", type=float, default=0.0, help="open loop: requests/s over all users; 0: closed")
    add("--duration", type=float, default=60.0, help="open loop: seconds of arrivals")
    add("--drain-timeout", type=float, default=60.0, help="open loop: wait for answers after")
    add("--arrival", default="poisson", help="open loop: poisson | constant")
    add("--request-timeout", type=float, default=300.0, help="seconds per request")
    add("--temperature", type=float, default=0.0)
    add("--records-file", default="", help="append one JSON line per request here")
    add("--application", default="",
        help="gRPC: the Serve application to call (needed where a cluster runs several)")


class RunPlan:
    """What every user of this locust process shares: the requests (handed out in order), the
    record file, and the count of open-loop senders still running."""

    def __init__(self, options):
        self.options = options
        self.requests = _requests(options)
        self._next = itertools.count()
        self._users = itertools.count()
        self._records = open(options.records_file, "a") if options.records_file else None
        self.senders = 0

    def next_request(self) -> workloads.LoadRequest:
        return self.requests[next(self._next) % len(self.requests)]

    def user_number(self) -> int:
        return next(self._users)

    def write(self, rec: RequestRecord) -> None:
        if self._records is not None:
            self._records.write(rec.to_json() + "\n")
            self._records.flush()

    def close(self) -> None:
        if self._records is not None:
            self._records.close()


def _requests(options) -> list[workloads.LoadRequest]:
    if options.workload_file:
        return workloads.load(options.workload_file)
    spec = workloads.WorkloadSpec(kind=options.workload, num_requests=options.num_requests,
                                  input_len=options.input_len, output_len=options.output_len,
                                  seed=options.seed)
    return workloads.build(spec, workloads.prompt_maker(options.model))


@events.init.add_listener
def _on_init(environment, **_kwargs):
    import grpc.experimental.gevent as grpc_gevent

    grpc_gevent.init_gevent()  # gRPC calls must yield to other greenlets
    if environment.parsed_options is not None:
        environment.baton_plan = RunPlan(environment.parsed_options)


@events.test_stop.add_listener
def _on_stop(environment, **_kwargs):
    """Locust writes its CSVs once a second and not again at the end: wait for one more write
    so the last second's requests are in them."""
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


@events.quitting.add_listener
def _on_quit(environment, **_kwargs):
    plan = getattr(environment, "baton_plan", None)
    if plan is not None:
        plan.close()


class StreamingUser(User):
    """Sends workload requests and measures their streams; subclasses supply ``stream``."""

    abstract = True
    wait_time = constant(0)
    protocol = ""

    @property
    def plan(self) -> RunPlan:
        return self.environment.baton_plan

    @task
    def load(self):
        if self.plan.options.rate > 0:
            self.open_loop()
        else:
            self.measure(self.plan.next_request())

    def open_loop(self):
        """Send on schedule, each request on its own greenlet; then drain and stop."""
        opts = self.plan.options
        users = max(1, getattr(opts, "num_users", None) or 1)
        number = self.plan.user_number()
        schedule = workloads.arrival_times(opts.rate / users, opts.duration, opts.arrival,
                                           seed=opts.seed + 7919 * number)
        self.plan.senders += 1
        group = Group()
        t0 = time.perf_counter()
        for offset in schedule:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            group.spawn(self.measure, self.plan.next_request(),
                        max(0.0, time.perf_counter() - t0 - offset))
        group.join(timeout=opts.drain_timeout)
        group.kill(block=True, timeout=10)  # the unfinished are recorded as errors
        self.plan.senders -= 1
        if self.plan.senders == 0 and getattr(opts, "headless", False):
            gevent.spawn(self.environment.runner.quit)
        raise StopUser()

    def measure(self, req: workloads.LoadRequest, lag_s: float = 0.0) -> RequestRecord:
        rec = RequestRecord(index=req.index, protocol=self.protocol, max_tokens=req.max_tokens,
                            start=time.time(), group=req.group, lag_s=lag_s)
        t0 = time.perf_counter()
        last = None
        try:
            for msg in self.stream(req):
                now = time.perf_counter() - t0
                if msg.tokens:
                    _add_tokens(rec, msg.tokens, now, last)
                    last = now
                if msg.finish_reason:
                    rec.finish_reason = msg.finish_reason
                if msg.usage:
                    rec.prompt_tokens = msg.usage.get("prompt_tokens", rec.prompt_tokens)
                    rec.cached_tokens = msg.usage.get("cached_tokens", rec.cached_tokens)
                if now > self.plan.options.request_timeout:
                    raise StreamError(f"no end after {self.plan.options.request_timeout:.0f}s")
            if rec.output_tokens == 0:
                rec.error = "the stream ended without tokens"
        except GreenletExit:
            rec.error = "unfinished when the run ended"
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a recorded error
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            rec.e2e_s = time.perf_counter() - t0
            self.report(rec)
        return rec

    def report(self, rec: RequestRecord) -> None:
        fire = self.environment.events.request.fire
        common = dict(request_type=self.protocol, response=None, context={})
        if rec.error is None:
            fire(name="TTFT", response_time=rec.ttft_s * 1e3, response_length=0,
                 exception=None, **common)
            for gap in rec.itl_s:
                fire(name="ITL", response_time=gap * 1e3, response_length=0, exception=None,
                     **common)
        fire(name="E2E", response_time=rec.e2e_s * 1e3, response_length=rec.output_tokens,
             exception=StreamError(rec.error) if rec.error else None, **common)
        self.plan.write(rec)

    def stream(self, req: workloads.LoadRequest):
        raise NotImplementedError


def _add_tokens(rec: RequestRecord, count: int, now: float, last: float | None) -> None:
    """First message: TTFT (its extra tokens came with no gap); later ones: the gap since the
    previous message, split evenly among the message's tokens."""
    if rec.ttft_s is None:
        rec.ttft_s = now
        rec.itl_s.extend([0.0] * (count - 1))
    else:
        rec.itl_s.extend([(now - last) / count] * count)
    rec.output_tokens += count


class OpenAIStreamUser(StreamingUser):
    """``/v1/completions`` (or ``/v1/chat/completions`` for chat requests) with ``stream``,
    ``ignore_eos`` and ``max_tokens``; tokens counted from each chunk's ``token_ids``."""

    protocol = "HTTP"

    def on_start(self):
        import requests
        from requests.adapters import HTTPAdapter

        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(pool_maxsize=1024))
        self.session.mount("https://", HTTPAdapter(pool_maxsize=1024))

    def on_stop(self):
        self.session.close()

    def stream(self, req: workloads.LoadRequest):
        opts = self.plan.options
        body = {"max_tokens": req.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": opts.temperature}
        if req.messages is not None:
            path, body["messages"] = "/v1/chat/completions", req.messages
        else:
            path, body["prompt"] = "/v1/completions", req.prompt
        with self.session.post(self.host.rstrip("/") + path, json=body, stream=True,
                               timeout=(10, opts.request_timeout)) as resp:
            if resp.status_code != 200:
                raise StreamError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            for event in sse.events(resp.iter_lines(chunk_size=None)):
                yield _sse_message(event)


def _sse_message(event: dict) -> StreamMessage:
    if (error := sse.failure(event)) is not None:
        raise StreamError(error)
    tokens, finish = 0, None
    for choice in event.get("choices", []):
        if "token_ids" in choice:  # Baton's extension: exact
            tokens += len(choice["token_ids"] or [])
        else:  # another OpenAI server: one token per non-empty chunk
            delta = choice.get("text") or (choice.get("delta") or {}).get("content")
            tokens += 1 if delta else 0
        finish = choice.get("finish_reason") or finish
    usage = event.get("usage")
    if usage:
        usage = {"prompt_tokens": usage.get("prompt_tokens"),
                 "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    return StreamMessage(tokens, finish, usage)


class GrpcStreamUser(StreamingUser):
    """``baton.v1.Baton/GenerateStream``; ``--host`` is ``HOST:PORT`` (``grpc://`` optional).
    Chat requests are sent as their messages joined into one prompt (gRPC has no chat)."""

    protocol = "gRPC"

    def on_start(self):
        import grpc

        from proto import baton_pb2_grpc

        self.channel = grpc.insecure_channel(self.host.removeprefix("grpc://").rstrip("/"))
        self.stub = baton_pb2_grpc.BatonStub(self.channel)

    def on_stop(self):
        self.channel.close()

    def stream(self, req: workloads.LoadRequest):
        import grpc

        from proto import baton_pb2

        opts = self.plan.options
        msg = baton_pb2.GenerateRequest(max_tokens=req.max_tokens, temperature=opts.temperature,
                                        ignore_eos=True)
        prompt = req.flat_prompt()
        if isinstance(prompt, str):
            msg.prompt = prompt
        else:
            msg.prompt_token_ids.extend(prompt)
        try:
            metadata = (("application", opts.application),) if opts.application else None
            for resp in self.stub.GenerateStream(msg, timeout=opts.request_timeout,
                                                 metadata=metadata):
                usage = None
                if resp.HasField("usage"):
                    usage = {"prompt_tokens": resp.usage.prompt_tokens,
                             "cached_tokens": resp.usage.cached_tokens}
                yield StreamMessage(len(resp.token_ids), resp.finish_reason or None, usage)
        except grpc.RpcError as exc:
            raise StreamError(f"gRPC {exc.code().name}: {exc.details()}") from None
