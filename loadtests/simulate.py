"""A discrete-event model of a Baton app, for the planner (``loadtests.plan``): DistServe's
method, simulating each layout at each load from a profile of the engine instead of deploying it.

The profile (``Profile``, measured on the GPU host by ``python -m loadtests.plan profile``) gives
three costs: a step that prefills ``P`` prompt tokens, a decode step of ``B`` sequences at a mean
context of ``C`` tokens, and a hand-over of ``N`` bytes (a fixed part and a rate). A step that
does both (chunked prefill beside decoding) costs the decode step plus the prefill's part above
its fixed cost. Each replica is simulated as Baton's scheduler runs it: running sequences first,
one token each, then waiting prompts in chunks under ``max_num_batched_tokens``, ``max_num_seqs``
and the KV capacity. A handed-over request first takes a sequence slot (``max_num_seqs``) and its
KV on the decode replica with the fewest sequences, as Baton's reservation does, waiting there in
order while that replica is full; then a prefill replica computes it, its KV comes in after the
pushes into that replica before it (one link per decode replica), and the decode replica's first
step after the KV lands gives the first token. Replicas that share one GPU (``gpus_per_replica``
< 1) share its time: steps that overlap each go at half speed.

What is left out, and so what the prediction's error includes: the served path's own time (the
HTTP/gRPC hops, tokenizing, the token channel: ``serve_overhead_ms`` adds a fixed part to every
first token), preemption (the KV capacity only holds admissions back), CUDA graphs' batch
padding, and the prefix cache beyond the shared-prefix workload's prefixes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from loadtests import metrics


class Profile(BaseModel):
    """What one engine costs on one kind of device, at one tensor-parallel size."""

    model_config = ConfigDict(extra="forbid")

    model: str
    device: str
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int  # prompt + output tokens the KV cache holds (one replica)
    prefill: list[tuple[int, float]]  # (prompt tokens in the step, ms)
    decode: list[tuple[int, int, float]]  # (batch, mean context tokens, ms)
    mixed: list[tuple[int, int, int, float]] = Field(default_factory=list)  # (B, C, P, ms) seen
    kv_bytes_per_token: int
    handover_fixed_ms: float = 5.0  # a hand-over's cost beside its bytes (calls, landing)
    handover_gb_s: float = 50.0  # the KV's copy rate between the replicas
    serve_overhead_ms: float = 0.0  # the served path's time to the first token beside the engine
    date: str = ""
    commit: str = ""

    # -- the cost model -------------------------------------------------------------------------
    def prefill_ms(self, tokens: int) -> float:
        return _interp(self.prefill, tokens)

    def prefill_fixed_ms(self) -> float:
        """The prefill step's cost at zero tokens (the line through the two smallest points)."""
        (t0, m0), (t1, m1) = sorted(self.prefill)[:2]
        return max(0.0, m0 - (m1 - m0) / (t1 - t0) * t0)

    def decode_ms(self, batch: int, context: float) -> float:
        """Bilinear over the (batch, context) grid, linear beyond its edges."""
        contexts = sorted({c for _, c, _ in self.decode})
        rows = []
        for c in contexts:
            rows.append((c, _interp([(b, ms) for b, cc, ms in self.decode if cc == c], batch)))
        return _interp(rows, context) if len(rows) > 1 else rows[0][1]

    def step_ms(self, batch: int, context: float, prefill_tokens: int) -> float:
        if not prefill_tokens:
            return self.decode_ms(batch, context) if batch else 0.0
        prefill = self.prefill_ms(prefill_tokens)
        if not batch:
            return prefill
        return self.decode_ms(batch, context) + prefill - self.prefill_fixed_ms()

    def handover_ms(self, tokens: int) -> float:
        return self.handover_fixed_ms + tokens * self.kv_bytes_per_token / self.handover_gb_s / 1e6


def _interp(points, x: float) -> float:
    """Piecewise linear through ``points`` (x, y), extended linearly past both ends."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    xs = [p[0] for p in pts]
    i = min(max(bisect.bisect_left(xs, x), 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


# -- the layout and the load ---------------------------------------------------------------------
@dataclass(frozen=True)
class SimLayout:
    """``prefill == 0``: colocated. ``gpus_per_replica`` < 1 packs replicas onto shared GPUs;
    ``mode`` is the disaggregation placement (``always``, or ``auto`` with its threshold)."""

    prefill: int
    decode: int
    gpus_per_replica: float = 1.0
    mode: str = "always"
    max_local_prefill_length: int = 1000
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def gpus(self) -> float:
        return self.gpus_per_replica * (self.prefill * self.prefill_tp + self.decode * self.decode_tp)

    @property
    def name(self) -> str:
        tp = lambda n: f"tp{n}" if n > 1 else ""  # noqa: E731
        if not self.prefill:
            return f"colo{self.decode}{tp(self.decode_tp)}"
        return f"{self.prefill}p{tp(self.prefill_tp)}{self.decode}d{tp(self.decode_tp)}"


@dataclass
class SimRequest:
    arrival: float
    prompt: int  # prompt tokens to compute (the uncached part)
    output: int
    context: int = 0  # prompt tokens in all (cached included)
    first: float | None = None
    tokens: list[float] = field(default_factory=list)  # when each output token was produced

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.tokens, self.tokens[1:])]


def requests_for(arrivals: list[float], inputs: list[int], outputs: list[int],
                 cached: list[int] | None = None) -> list[SimRequest]:
    cached = cached or [0] * len(inputs)
    return [SimRequest(t, i - c, o, i) for t, i, o, c in zip(arrivals, inputs, outputs, cached)]


# -- the simulation ----------------------------------------------------------------------------
class _Gpu:
    """One device, shared by the steps running on it at once (processor sharing: with k steps
    each goes at 1/k speed; a GPU time-slices two processes' kernels at a finer grain than a
    step, so a decode step beside a long prefill step is slowed, not held back for all of it)."""

    def __init__(self, sim: "Simulation"):
        self.sim = sim
        self.active: dict[int, list] = {}  # step id -> [seconds of work left, done(end)]
        self._t = 0.0
        self._version = 0
        self._ids = itertools.count()

    def run(self, seconds: float, done) -> None:
        self._settle()
        self.active[next(self._ids)] = [seconds, done]
        self._schedule()

    def _settle(self) -> None:
        now = self.sim.now
        if self.active:
            share = (now - self._t) / len(self.active)
            for work in self.active.values():
                work[0] -= share
        self._t = now

    def _schedule(self) -> None:
        self._version += 1
        if self.active:
            left = min(w[0] for w in self.active.values())
            version = self._version
            self.sim.at(self.sim.now + max(0.0, left) * len(self.active),
                        lambda: self._finish(version))

    def _finish(self, version: int) -> None:
        if version != self._version:
            return  # the active steps changed since this was scheduled
        self._settle()
        first = min(self.active, key=lambda k: self.active[k][0])
        _, done = self.active.pop(first)
        self._schedule()
        done(self.sim.now)


@dataclass
class _Seq:
    req: SimRequest
    computed: int = 0  # prompt tokens computed
    made: int = 0  # output tokens produced
    landed: bool = False  # decode role: its KV has arrived
    target: "_Replica | None" = None  # the decode replica a prefilled prompt goes to


class _Replica:
    """One engine: the scheduler's step, timed by the profile."""

    def __init__(self, sim: "Simulation", profile: Profile, gpu: _Gpu, role: str):
        self.sim, self.profile, self.gpu, self.role = sim, profile, gpu, role
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.reserved = 0  # decode role: sequences whose KV is on its way
        self.reserved_kv = 0  # decode role: their tokens (prompt and output)
        self.queued: list[_Seq] = []  # decode role: hand-overs waiting for a slot here
        self.link_free = 0.0  # decode role: when the KV arriving here has all come in
        self.busy = False
        self.busy_s = 0.0

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + self.reserved + len(self.queued)

    def has_room(self, seq: _Seq) -> bool:
        """Decode role: a slot and the KV for ``seq`` (its reservation)."""
        p = self.profile
        return (len(self.running) + self.reserved < p.max_num_seqs
                and self.kv_used() + self.reserved_kv + seq.req.context + seq.req.output
                <= p.kv_capacity_tokens)

    def kv_used(self) -> int:
        return sum(s.req.context + s.made for s in self.running)

    def submit(self, seq: _Seq) -> None:
        (self.running if seq.landed else self.waiting).append(seq)
        self.kick()

    def kick(self) -> None:
        if not self.busy and (self.waiting or self.running):
            self.busy = True
            self.sim.at(self.sim.now, self._step)

    def _plan(self):
        """This step's decoding sequences and prefill chunks, as the scheduler picks them."""
        p = self.profile
        budget = p.max_num_batched_tokens
        decoding = [s for s in self.running if s.computed >= s.req.prompt]
        budget -= len(decoding)
        chunks = []
        for s in self.running:
            if s.computed < s.req.prompt and budget > 0:
                n = min(s.req.prompt - s.computed, budget)
                chunks.append((s, n))
                budget -= n
        kv = self.kv_used()
        while self.waiting and budget > 0 and \
                len(self.running) + self.reserved < p.max_num_seqs:
            s = self.waiting[0]
            if kv + s.req.context + s.req.output > p.kv_capacity_tokens and self.running:
                break
            self.waiting.pop(0)
            self.running.append(s)
            kv += s.req.context + s.req.output
            n = min(s.req.prompt - s.computed, budget)
            chunks.append((s, n))
            budget -= n
        return decoding, chunks

    def _step(self) -> None:
        decoding, chunks = self._plan()
        if not decoding and not chunks:
            self.busy = False
            return
        context = sum(s.req.context + s.made for s in decoding) / max(1, len(decoding))
        ms = self.profile.step_ms(len(decoding), context, sum(n for _, n in chunks))
        self.busy_s += ms / 1e3
        self.gpu.run(ms / 1e3, lambda end: self._done(decoding, chunks, end))

    def _done(self, decoding, chunks, end: float) -> None:
        for s, n in chunks:
            s.computed += n
            if s.computed >= s.req.prompt:
                self.sim.prefilled(self, s, end)
        for s in decoding:
            self.sim.token(self, s, end)
        self.busy = False
        self.kick()


class Simulation:
    """Every replica of a layout, the router, and the requests' clock."""

    def __init__(self, layout: SimLayout, profiles: dict[int, Profile]):
        self.layout = layout
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        per_gpu = max(1, round(1 / layout.gpus_per_replica)) if layout.gpus_per_replica < 1 else 1
        gpus = itertools.cycle([_Gpu(self) for _ in range(math.ceil(
            (layout.prefill + layout.decode) / per_gpu))]) if per_gpu > 1 else None
        # Replicas that share GPUs are placed one per GPU in turn (prefill 0, decode 0, ...), as
        # the benchmarks' layouts on one GPU do; otherwise each has its own.
        gpu = (lambda: next(gpus)) if gpus else (lambda: _Gpu(self))
        self.prefill = [_Replica(self, profiles[layout.prefill_tp], gpu(), "prefill")
                        for _ in range(layout.prefill)]
        self.decode = [_Replica(self, profiles[layout.decode_tp], gpu(), "decode")
                       for _ in range(layout.decode)]
        self.serve_overhead_s = profiles[layout.decode_tp].serve_overhead_ms / 1e3

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        for r in requests:
            self.at(r.arrival, lambda r=r: self._arrive(r))
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        return requests

    # -- the request's path ------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        decode = min(self.decode, key=_Replica.load)
        local = not self.prefill or (self.layout.mode == "auto"
                                     and req.prompt <= self.layout.max_local_prefill_length)
        if local:
            decode.submit(_Seq(req))
            return
        seq = _Seq(req, target=decode)
        if decode.queued or not decode.has_room(seq):
            decode.queued.append(seq)  # waits for a slot, in order
            return
        self._hand_over(decode, seq)

    def _hand_over(self, decode: _Replica, seq: _Seq) -> None:
        """``seq``'s reservation on ``decode``, then its prefill elsewhere."""
        decode.reserved += 1
        decode.reserved_kv += seq.req.context + seq.req.output
        prefill = min(self.prefill, key=_Replica.load)
        prefill.submit(seq)

    def _freed(self, decode: _Replica) -> None:
        """A sequence left ``decode``: hand over those waiting for its slots, in order."""
        while decode.queued and decode.has_room(decode.queued[0]):
            self._hand_over(decode, decode.queued.pop(0))

    def prefilled(self, replica: _Replica, seq: _Seq, t: float) -> None:
        if replica.role == "decode":
            self.token(replica, seq, t)
            return
        replica.running.remove(seq)
        replica.kick()
        target = seq.target
        # The KV's bytes come in one push after another (the replica's link); the fixed part
        # (calls, landing) is each hand-over's own.
        p = replica.profile
        moving = p.handover_ms(seq.req.context) - p.handover_fixed_ms
        target.link_free = max(t, target.link_free) + moving / 1e3
        landed = target.link_free + p.handover_fixed_ms / 1e3

        def land():
            target.reserved -= 1
            target.reserved_kv -= seq.req.context + seq.req.output
            seq.landed, seq.computed = True, seq.req.prompt
            target.submit(seq)
        self.at(landed, land)

    def token(self, replica: _Replica, seq: _Seq, t: float) -> None:
        req = seq.req
        if req.first is None:
            req.first = t + self.serve_overhead_s
        req.tokens.append(t)
        seq.made += 1
        if seq.made >= req.output:
            replica.running.remove(seq)
            if replica.queued:
                self._freed(replica)


# -- what a run gives -----------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """``loadtests.metrics.percentile``, NaN for no values."""
    p = metrics.percentile(values, q)
    return float("nan") if p is None else p


def summarize(requests: list[SimRequest], ttft_ms: float | None = None,
              itl_ms: float | None = None, window_s: float | None = None,
              deadline_s: float | None = None) -> dict:
    """The sweep's figures (``loadtests.metrics.summarize``'s names) of a simulated run; the SLO
    is met by a request whose TTFT and mean inter-token gap are within the bounds.
    ``deadline_s``: as the sweep's drain, a request not finished by then is an error (its tokens
    and latencies left out, the SLO missed)."""
    done = [r for r in requests if r.first is not None
            and (deadline_s is None or (len(r.tokens) >= r.output and r.tokens[-1] <= deadline_s))]
    ttft = [r.first - r.arrival for r in done]
    gaps = [g for r in done for g in r.gaps]
    end = max((r.tokens[-1] for r in done if r.tokens), default=0.0)
    start = min((r.arrival for r in requests), default=0.0)
    window = max(end - start, window_s or 0.0)
    tokens = sum(len(r.tokens) for r in done)

    def met(r) -> bool:
        tpot = sum(r.gaps) / len(r.gaps) if r.gaps else 0.0
        return ((ttft_ms is None or (r.first - r.arrival) * 1e3 <= ttft_ms)
                and (itl_ms is None or tpot * 1e3 <= itl_ms))
    return {"requests": len(requests), "ttft_p50_ms": percentile(ttft, 50) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3, "itl_p50_ms": percentile(gaps, 50) * 1e3,
            "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "output_tok_s": tokens / window if window else 0.0,
            "achieved_rps": len(done) / window if window else 0.0,
            "slo_fraction": sum(met(r) for r in done) / max(1, len(requests)),
            "errors": len(requests) - len(done)}


def simulate(layout: SimLayout, profiles: dict[int, Profile], requests: list[SimRequest],
             **slo) -> dict:
    Simulation(layout, profiles).run(requests)
    return summarize(requests, **slo)
