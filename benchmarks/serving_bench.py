"""The served path next to the offline engine: the same requests, the same hardware, one run.

    python -m benchmarks.serving_bench --model tiny --streams 1,16,64,128 --output-len 64  # CPU
    python -m benchmarks.serving_bench --model tiny --stub-forward ...   # CPU, forward is free
    python -m benchmarks.serving_bench --model dummy:Qwen3-0.6B --streams 1,16,64,256,512 \\
        --layouts colo,1p1d --gpus-per-role 0.5 --json results/serving.json      # GPU host
    ... --layouts colo,1p1d,colo-tp2 --gpus-per-role 1     # two GPUs: one per role, or one split
    ... --dashboard results/dashboard.png   # also draw the Grafana dashboard from the run
    ... --served-engine-option 'speculative_config={...}'  # served speculating, offline not
    ... --temperature 1   # sampled requests (then the "same" column is nan)
    ... --temperature 0.6 --top-k 20 --top-p 0.95   # Qwen3's recommended sampling

For each stream count the same requests (random token-id prompts, greedy, ``ignore_eos``) run
through ``LLM.generate`` and through the served app (sent all at once by client processes),
over HTTP (SSE) and gRPC, for each layout; every point (offline and served) starts with cold
prefix caches, so no protocol gets the prompts of another's point from the cache. It prints served/offline output tokens/s, TTFT
p50/p99, the delay from the engine step that produced a token to the client (p50/p99), tokens
per streamed chunk, whether the served tokens equal the offline ones, the CPU each process kind
used, and at zero load the served TTFT minus the engine's own time to first token with where
that time goes (from the timings the app returns when asked: HTTP's ``include_timing``, gRPC's
``include_timing`` field; ``--protocols http-untimed,grpc-untimed`` do not ask).

``--stub-forward`` (CPU only) replaces the model's forward pass with fixed logits, offline and in
the replicas, so what is left is the cost of scheduling and of serving. ``--cpu`` runs the CPU
configuration on a GPU host (every engine on the CPU, no GPU asked of Ray): the app's host path
on that host's CPU, to set beside the same run on a CPU-only host and the GPU configuration.
``--switch-interval`` sets Python's GIL switch interval in the replicas
(``sys.setswitchinterval``; default 5 ms), to measure how much the engine thread waits for the
GIL.

Layouts: ``colo`` (one replica that prefills and decodes), ``1p1d`` (a prefill and a decode
replica, ``--gpus-per-role`` GPUs each), ``colo-tpN`` (one colocated replica split over N GPUs,
compared with an offline engine split the same way). A disaggregated layout hands every request
over (``--disaggregation always``, what ``1p1d`` names); ``--disaggregation auto`` measures the
app's default instead, which prefills short prompts on the decode replica. A layout's own
``:mode`` suffix overrides it, so one run compares them: ``--layouts colo,1p1d:always,1p1d:auto``.

``--long-prompts 0.2:4096`` makes a mixed load: every fifth prompt has 4,096 tokens instead of
``--input-len``. Each point then also reports the TTFT of each prompt length, and every point the
inter-token latency (ITL: the gap between a request's chunks, shared by the chunk's tokens).
``--rate R`` sends each point's requests at Poisson times (R per second, seed 0) instead of all
at once, so layouts are compared at a load each carries (the % of offline then says nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context

from benchmarks.lib import local_ray, served
from loadtests import sse, workloads
from loadtests.layouts import Resources, parse_layout

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = {"temperature": 0.0}  # a request's sampling fields where none are asked


# -- the stub forward -----------------------------------------------------------------------
def stub_forward() -> None:
    """Make every ModelRunner return fixed logits without running the model (worker setup hook
    of the replicas, and called in the driver)."""
    import torch

    from engine.model_runner import ModelRunner

    def _forward(self, input_ids, positions, meta, logit_rows, prompt=None):
        if not logit_rows:
            return None
        cached = getattr(self, "_stub_logits", None)
        if cached is None or cached.shape[0] < len(logit_rows):
            vocab = self.model.compute_logits(torch.zeros(1, self.model.config.hidden_size,
                                                          dtype=self.dtype,
                                                          device=self.device)).shape[-1]
            g = torch.Generator().manual_seed(0)
            cached = torch.randn(max(len(logit_rows), 512), vocab, generator=g).to(self.device)
            self._stub_logits = cached
        return cached[: len(logit_rows)]

    ModelRunner._forward = _forward


def worker_setup() -> None:
    """Setup hook of every replica process: the stub forward and the GIL switch interval that
    the driver asked for (through environment variables)."""
    import sys

    if os.environ.get("BENCH_STUB_FORWARD") == "1":
        stub_forward()
    if os.environ.get("BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))


# -- the client (its own processes) ---------------------------------------------------------
@dataclass
class Record:
    index: int
    sent: float
    prompt_len: int = 0
    first: float = 0.0
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    chunks: int = 0
    delays: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per chunk
    timing: dict | None = None
    error: str | None = None


async def _http_one(session, url: str, index: int, prompt, max_tokens: int, timeout: float,
                    timed: bool = True, sampling: dict | None = None) -> Record:
    body = {"prompt": prompt, "max_tokens": max_tokens, **(sampling or GREEDY),
            "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "include_timing": timed}}
    rec = Record(index, time.time(), len(prompt))
    try:
        async with session.post(url, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for ev in sse.aevents(resp.content):
                now = time.time()
                if (error := sse.failure(ev)) is not None:
                    rec.error = error
                    break
                if ev["choices"]:
                    toks = ev["choices"][0]["token_ids"]
                    if toks:
                        rec.first = rec.first or now
                        rec.tokens += toks
                        rec.chunks += 1
                        rec.arrivals.append((now, len(toks)))
                        if "produced_at" in ev:  # asked for with the timings
                            rec.delays.append((now - ev["produced_at"], len(toks)))
                elif "timing" in (ev.get("usage") or {}):
                    rec.timing = ev["usage"]["timing"]
    except Exception as exc:  # noqa: BLE001 - reported per request
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.time()
    return rec


async def _grpc_one(stub, pb, index: int, prompt, max_tokens: int, timeout: float,
                    timed: bool = True, sampling: dict | None = None) -> Record:
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens,
                             **(sampling or GREEDY), ignore_eos=True, include_timing=timed)
    rec = Record(index, time.time(), len(prompt))
    try:
        async for msg in stub.GenerateStream(req, timeout=timeout):
            now = time.time()
            if msg.timing_json:  # asked: one more message after the last
                rec.timing = json.loads(msg.timing_json)
            if msg.token_ids:
                rec.first = rec.first or now
                rec.tokens += list(msg.token_ids)
                rec.chunks += 1
                rec.arrivals.append((now, len(msg.token_ids)))
                rec.delays.append((now - msg.produced_at, len(msg.token_ids)))
    except Exception as exc:  # noqa: BLE001
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.time()
    return rec


async def _client(protocol: str, address: str, jobs, start_at: float, max_tokens: int,
                  timeout: float, sequential: bool, sampling: dict | None = None
                  ) -> list[Record]:
    """All ``jobs`` at once at ``start_at`` (or one after another over one warm connection,
    after a first request that is not recorded)."""
    timed = not protocol.endswith("-untimed")  # untimed: no timings asked, so no hops
    if protocol.startswith("http"):
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async def health():
                async with s.get(f"{address}/health") as resp:
                    await resp.read()

            # One open connection per request before the burst, as a client with a warm
            # keep-alive pool has: the burst then measures the server, not connection setup.
            await asyncio.gather(*[health() for _ in range(1 if sequential else len(jobs))])

            def one(i, p):
                return _http_one(s, f"{address}/v1/completions", i, p, max_tokens, timeout,
                                 timed, sampling)
            return await _run_jobs(one, jobs, start_at, sequential)
    import grpc

    from proto import baton_pb2, baton_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = baton_pb2_grpc.BatonStub(channel)
        await channel.channel_ready()
        return await _run_jobs(lambda i, p: _grpc_one(stub, baton_pb2, i, p, max_tokens, timeout,
                                                      timed, sampling),
                               jobs, start_at, sequential)


async def _run_jobs(one, jobs, start_at: float, sequential: bool) -> list[Record]:
    """``jobs``: (index, prompt) or (index, prompt, seconds after ``start_at`` to send it)."""
    if sequential:
        await one(-1, jobs[0][1])  # warms the connection
        return [await one(i, p) for i, p, *_ in jobs[1:]]

    async def at(i, p, offset=0.0):
        await asyncio.sleep(max(0.0, start_at + offset - time.time()))
        return await one(i, p)
    return await asyncio.gather(*[at(*job) for job in jobs])


def client_process(protocol, address, jobs, start_at, max_tokens, timeout,
                   sequential=False, sampling=None) -> list[dict]:
    import sys

    sys.path.insert(0, HERE)
    records = asyncio.run(_client(protocol, address, jobs, start_at, max_tokens, timeout,
                                  sequential, sampling))
    return [asdict(r) for r in records]


# -- measuring ------------------------------------------------------------------------------
def _pct(values, q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _weighted_pct(pairs, q: float) -> float:
    """Percentile of a value that each of ``n`` tokens has, over (value, n) pairs."""
    pairs = sorted(pairs)
    total = sum(n for _, n in pairs)
    if not total:
        return float("nan")
    seen = 0
    for value, n in pairs:
        seen += n
        if seen >= q * total:
            return value
    return pairs[-1][0]


class CpuMeter:
    """CPU seconds used by the serving processes, by kind, between start() and stop()."""

    KINDS = {"Router": "router", "DecodeServer": "decode", "PrefillServer": "prefill",
             "haproxy": "haproxy", "ProxyActor": "proxy", "multiprocessing.spawn": "client"}

    def __init__(self):
        try:
            import psutil
        except ImportError:  # Ray carries its own copy
            from ray.thirdparty_files import psutil

        self.procs = {}
        for p in psutil.process_iter(["pid", "name", "cmdline"]):
            title = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
            for key, kind in self.KINDS.items():
                if key in title:
                    self.procs[p.pid] = (kind, p)
                    break

    def _sample(self) -> dict[int, float]:
        out = {}
        for pid, (_, p) in self.procs.items():
            try:
                t = p.cpu_times()
                out[pid] = t.user + t.system
            except Exception:  # noqa: BLE001 - a process gone
                pass
        return out

    def pid(self, kind: str) -> int | None:
        return next((pid for pid, (k, _) in self.procs.items() if k == kind), None)

    def start(self) -> None:
        self.t0, self.c0 = time.time(), self._sample()

    def stop(self) -> dict[str, float]:
        dt, c1 = time.time() - self.t0, self._sample()
        use: dict[str, float] = {}
        for pid, cpu in c1.items():
            kind = self.procs[pid][0]
            use[kind] = use.get(kind, 0.0) + (cpu - self.c0.get(pid, cpu)) / dt
        return use


def inter_token(records: list[dict]) -> list[tuple[float, int]]:
    """(seconds between tokens, tokens) for every chunk after a request's first: the gap since
    the request's previous chunk, shared by the chunk's tokens."""
    pairs = []
    for r in records:
        arrivals = r.get("arrivals") or []
        for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
            pairs.append(((t1 - t0) / n, n))
    return pairs


def ttft_by_length(records: list[dict]) -> dict[int, dict]:
    """TTFT p50/p99 (ms) of each prompt length, where a point mixes lengths."""
    lengths = sorted({r["prompt_len"] for r in records})
    if len(lengths) < 2:
        return {}
    out = {}
    for n in lengths:
        ttft = [r["first"] - r["sent"] for r in records if r["prompt_len"] == n]
        out[n] = {"requests": len(ttft), "ttft_p50_ms": _pct(ttft, 0.5) * 1e3,
                  "ttft_p99_ms": _pct(ttft, 0.99) * 1e3}
    return out


def summarize(records: list[dict], offline_tokens: list[list[int]], wall: float) -> dict:
    """Throughput, latencies, chunking; ``same_tokens``: the share of requests whose tokens equal
    the offline run of the same batch (on random bf16 weights a different batching on the GPU
    can change a greedy token, so only the CPU and batch-1 figures are a strict test)."""
    ok = [r for r in records if not r["error"]]
    tokens = sum(len(r["tokens"]) for r in ok)
    delays = [pair for r in ok for pair in r["delays"]]
    gaps = inter_token(ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "first_error": next((r["error"] for r in records if r["error"]), None),
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": _pct([r["first"] - r["sent"] for r in ok], 0.5) * 1e3,
        "ttft_p99_ms": _pct([r["first"] - r["sent"] for r in ok], 0.99) * 1e3,
        "delay_p50_ms": _weighted_pct(delays, 0.5) * 1e3,
        "delay_p99_ms": _weighted_pct(delays, 0.99) * 1e3,
        "itl_p50_ms": _weighted_pct(gaps, 0.5) * 1e3,
        "itl_p99_ms": _weighted_pct(gaps, 0.99) * 1e3,
        "ttft_by_len": ttft_by_length(ok),
        "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in ok)),
        "same_tokens": sum(r["tokens"] == offline_tokens[r["index"]] for r in ok) / max(1, len(ok)),
    }


def breakdown(records: list[dict]) -> dict[str, float]:
    """Median milliseconds of each hop to the first token (records with timings: HTTP and gRPC)."""
    hops: dict[str, list[float]] = {}

    def add(name, a, b):
        if a and b:
            hops.setdefault(name, []).append((b - a) * 1e3)

    for r in records:
        t = r.get("timing")
        if not t or not t.get("decode"):
            continue
        rt, dt = t["router"], t["decode"]
        add("client -> ingress", r["sent"], rt["received"])
        # HTTP: to the ingress's app (HAProxy, Serve's direct ingress), then its body's parse
        add("(of which) client -> ingress app", r["sent"], rt.get("arrived"))
        add("(of which) ingress: parse, check", rt.get("arrived"), rt["received"])
        add("ingress: validate, submit", rt["received"], rt["submitted"])
        # the decode replica's first sight of the request: its early start, where there was one
        add("Serve call -> decode", rt["submitted"], dt["received"])
        # started early: its Serve call reached the replica this long after the start
        add("(early start) -> its Serve call", dt["received"], dt.get("claimed"))
        if dt.get("first_token_by_prefill"):  # no room here: queued, its first token made there
            add("decode: no room, queue here", dt["received"], dt["queued"])
            add("first-token call to prefill", dt["prefill_called"], dt["prefill_returned"])
            add("decode: publish that token", dt["prefill_returned"], dt["first_token"])
        elif dt["prefill_called"]:
            if (dt.get("reserved") or 0) > dt["prefill_called"]:  # sent ahead of its reservation
                add("decode: to the hand-over's send", dt["received"], dt["prefill_called"])
                add("(beside it) to the engine, reserve", dt["received"], dt["reserved"])
            else:
                add("decode: reserve, lease", dt["received"], dt["prefill_called"])
                add("(of which) to the engine, reserve", dt["received"], dt.get("reserved"))
                add("(of which) back to the loop, send", dt.get("reserved"),
                    dt["prefill_called"])
            pt = dt.get("prefill") or {}  # the hand-over's parts, as the prefill replica saw them
            if pt and dt["first_token"] < dt["prefill_returned"]:  # the first token ahead of KV
                add("hand-over to the first token", dt["prefill_called"], dt["first_token"])
                add("(of which) early start or call -> prefill", dt["prefill_called"],
                    pt["received"])
                if pt.get("sampled"):  # the prefill's engine thread published the token
                    add("(of which) prefill: to its engine", pt["received"], pt.get("added"))
                    add("(of which) prefill: engine to the first token", pt.get("added"),
                        pt["sampled"])
                    add("(of which) first token -> decode", pt["sampled"],
                        dt.get("first_arrived"))
                    add("(of which) decode: publish it", dt.get("first_arrived"),
                        dt["first_token"])
                else:
                    add("(of which) prefill: queue, compute", pt["received"], pt["prefilled"])
                    add("(of which) first token -> decode, published", pt["prefilled"],
                        dt["first_token"])
                add("(after it) prefill: push", pt["prefilled"], pt["pushed"])
                add("(after it) answer -> decode", pt["pushed"], dt["prefill_returned"])
            else:
                add("prefill call (prefill + push)", dt["prefill_called"], dt["prefill_returned"])
                if pt:
                    add("(of which) Serve call -> prefill", dt["prefill_called"], pt["received"])
                    add("(of which) prefill: queue, compute", pt["received"], pt["prefilled"])
                    add("(of which) prefill: push", pt["prefilled"], pt["pushed"])
                    add("(of which) answer -> decode", pt["pushed"], dt["prefill_returned"])
                add("decode: land, admit", dt["prefill_returned"], dt["first_token"])
        else:
            add("decode: queue", dt["received"], dt["queued"])
            add("engine: to first token", dt["queued"], dt["first_token"])
        add("token channel -> ingress", dt["first_token"], rt["first_token"])
        add("ingress -> client", rt["first_token"], r["first"])
    return {k: statistics.median(v) for k, v in hops.items()}


def warm_up_sizes(prompts, streams: list[int]) -> list[int]:
    """How many prompts each warm-up burst sends (8 tokens each), offline and served alike:
    every point's stream count, so that no point's first burst pays the engine's first prefill
    of its size (0.6B, 64 streams: 62-208 ms to the first token against 38-42 ms after)."""
    return sorted({min(16, len(prompts)), *streams})


# -- offline --------------------------------------------------------------------------------
def engine_rates(before: dict, after: dict, wall: float) -> dict:
    """What an engine did between two stats snapshots: tokens per second of stepping, mean step
    time, tokens per step and the share of the wall time spent stepping."""
    d = {k: after[k] - before[k] for k in after}
    return {"engine_tok_s": d["output_tokens"] / d["step_seconds"] if d["step_seconds"] else 0.0,
            "step_ms": 1e3 * d["step_seconds"] / max(1, d["steps"]),
            "tokens_per_step": d["output_tokens"] / max(1, d["steps"]),
            "steps": d["steps"], "scheduled_per_step": d["scheduled_tokens"] / max(1, d["steps"]),
            "prompt_steps": d["prompt_steps"],
            "prompt_step_ms": 1e3 * d["prompt_step_seconds"] / max(1, d["prompt_steps"]),
            "other_step_ms": 1e3 * (d["step_seconds"] - d["prompt_step_seconds"])
            / max(1, d["steps"] - d["prompt_steps"]),
            "busy": d["step_seconds"] / wall if wall > 0 else 0.0}


def sampling_of(args) -> dict:
    """The requests' sampling fields: the temperature, top-k and top-p, every one sent (an
    unset field would take the served model's generation config, which the offline engine's
    ``SamplingParams`` does not)."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}


def offline_runs(engine_kw: dict, prompts, streams: list[int], max_tokens: int,
                 ttft_prompts, sampling: dict | None = None) -> tuple[dict, dict, float]:
    """Per stream count: tok/s, every request's tokens and the engine's rates; and the engine's
    median time from a request's arrival to its first token alone (ms)."""
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kw)
    params = SamplingParams(**(sampling or GREEDY), max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(**(sampling or GREEDY), max_tokens=8, ignore_eos=True)
    for n in warm_up_sizes(prompts, streams):
        llm.generate(prompts[:n], warm, use_tqdm=False)
    tok_s, tokens = {}, {}
    for n in streams:
        llm.engine.reset_prefix_cache()  # as the served points: every point cold
        before = asdict(llm.engine.stats)
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:n], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tok_s[n] = {"tok_s": sum(len(o.token_ids) for o in outs) / wall,
                    **engine_rates(before, asdict(llm.engine.stats), wall)}
        tokens[n] = [o.token_ids for o in outs]
    first = []
    engine = llm.engine
    one = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for p in ttft_prompts:
        t0 = time.perf_counter()
        rid = engine.add_request(p, one)
        while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            pass
        first.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()  # a split engine's other ranks, now
    del llm, engine
    gc.collect()
    try:
        import torch
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
    return tok_s, tokens, statistics.median(first) if first else float("nan")


# -- serving --------------------------------------------------------------------------------
def layout_tp(layout: str) -> int:
    """The ranks a layout's replica is split over (``colo-tp2``: 2; otherwise 1)."""
    base = layout.split(":", 1)[0]
    return int(base.split("-tp", 1)[1]) if "-tp" in base else 1


def layout_mode(layout: str, default: str) -> str:
    """A disaggregated layout's placement: its ``:mode`` suffix (``1p1d:auto``) or ``default``
    (``--disaggregation``)."""
    mode = layout.split(":", 1)[1] if ":" in layout else default
    if mode not in ("always", "auto", "never"):
        raise SystemExit(f"layout {layout!r}: the placement is always, auto or never")
    return mode


def colocated(layout: str) -> bool:
    return layout.split(":", 1)[0].split("-", 1)[0] == "colo"


def layout_config(layout: str, engine: dict, args) -> dict:
    """The app config of a layout (``loadtests.layouts``'s, plus ``-tpN``): every replica takes
    whatever it is sent (throughput, not admission, is measured); replicas that share a GPU
    each size their KV cache by their share of it."""
    shape = parse_layout(layout.split(":", 1)[0].split("-tp", 1)[0])
    gpus = args.colo_gpus if shape.colocated else args.gpus_per_role
    config = shape.app_config(engine, Resources(num_gpus=gpus, num_cpus=args.role_cpus),
                              transfer={"backend": args.backend,
                                        "push_at_step_end": args.push_at_step_end},
                              router={"num_replicas": args.routers,
                                      "request_timeout_s": args.timeout,
                                      "early_start": not args.no_early_start,
                                      "http_fast_path": not args.no_http_fast_path})
    for role in ("prefill", "decode"):
        if role in config:
            config[role].update(max_ongoing_requests=4096, max_queued_requests=-1)
            if not shape.colocated and "gpu_memory_utilization" in engine and gpus < 1:
                config[role]["engine"] = {
                    "gpu_memory_utilization": engine["gpu_memory_utilization"] * gpus}
    if layout_tp(layout) > 1:
        config["decode"]["tensor_parallel_size"] = layout_tp(layout)
    if not shape.colocated:
        config["disaggregation"] = {"mode": layout_mode(layout, args.disaggregation)}
        if args.itl_target_ms:
            config["disaggregation"]["itl_target_ms"] = args.itl_target_ms
    return config


def run_point(pool, protocol, address, prompts, n, max_tokens, clients, timeout,
              offsets: list[float] | None = None, sampling: dict | None = None):
    """``n`` requests at once, or each at its offset (seconds) after the start."""
    jobs = [(i, p, offsets[i] if offsets else 0.0) for i, p in enumerate(prompts[:n])]
    k = max(1, min(clients, n))
    parts = [jobs[i::k] for i in range(k)]
    start_at = time.time() + 1.0  # every client process ready and connected
    futures = [pool.submit(client_process, protocol, address, part, start_at, max_tokens, timeout,
                           False, sampling) for part in parts]
    span = max(offsets[:n]) if offsets else 0.0
    records = [r for f in futures for r in f.result(timeout=timeout + span + 60)]
    wall = max(r["end"] for r in records) - start_at
    return records, wall


def start_py_spy(pid: int | None, args, name: str):
    """``--py-spy S``: sample the decode replica's threads that hold the GIL for S seconds,
    starting a second into the point (collapsed stacks under ``--profile-dir``)."""
    if not args.py_spy or pid is None:
        return None
    import shutil
    import subprocess
    import sys

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(args.profile_dir, exist_ok=True)
    out = os.path.join(args.profile_dir, f"decode-{name}.txt")
    return subprocess.Popen(["sh", "-c", f"sleep 1; {spy} record --gil --nonblocking -r 200 "
                             f"-d {args.py_spy} -p {pid} -f raw -o {out} >{out}.log 2>&1"])


def engine_stats(role: str = "DecodeServer") -> dict:
    """The engine counters of the role's (one) replica."""
    from deploy.ray_env import driver_handle

    return driver_handle(role).engine_stats.remote().result()


def early_starts(role: str = "DecodeServer") -> dict:
    """The role's (one) replica's early starts so far: claimed, dropped (``router.early_start``)."""
    from deploy.ray_env import driver_handle

    return driver_handle(role).early_starts.remote().result()


def early_since(before: dict, role: str = "DecodeServer") -> dict:
    return {k: v - before.get(k, 0) for k, v in early_starts(role).items()}


def reset_prefix_caches(layout: str) -> None:
    """Every point starts with cold prefix caches (the layouts run one replica per role): the
    points replay the same prompts, and a warm cache would prefill the second protocol's for
    free (measured before this: gRPC, run after HTTP, got every prompt from the cache)."""
    from deploy.ray_env import driver_handle

    for role in ("DecodeServer",) + (("PrefillServer",) if not colocated(layout) else ()):
        driver_handle(role).reset_prefix_cache.remote().result()


def check_fits(layout: str, config: dict) -> None:
    """Refuse a layout the cluster cannot place (Serve would wait for it forever)."""
    import ray

    roles = [config["decode"]] + ([config["prefill"]] if "prefill" in config else [])
    need = {"CPU": sum(r["num_cpus"] for r in roles) + 0.25 * config["router"]["num_replicas"],
            "GPU": sum(r["num_gpus"] * r.get("tensor_parallel_size", 1) for r in roles)}
    have = ray.cluster_resources()
    for kind, n in need.items():
        if n > have.get(kind, 0.0) + 1e-9:
            raise SystemExit(f"{layout} needs {n:g} {kind}s; the cluster has "
                             f"{have.get(kind, 0.0):g}")


def serve_layout(layout, config, args, pool, prompts, offline_tokens, fresh_prompts, out):
    check_fits(layout, config)
    with served(config, args.timeout) as app:
        print(f"{layout}: ready in {app.ready_s:.0f}s", flush=True)
        addresses = {"http": app.url, "grpc": app.grpc, "http-untimed": app.url,
                     "grpc-untimed": app.grpc}
        for protocol in args.protocols:
            serve_protocol(layout, protocol, addresses[protocol], args, pool, prompts,
                           offline_tokens, fresh_prompts, out)


def serve_protocol(layout, protocol, address, args, pool, prompts, offline_tokens,
                   fresh_prompts, out) -> None:
    """One protocol's points on a served layout: warm-up, zero load, each stream count."""
    from engine import SamplingParams

    sampling = sampling_of(args)
    sampled = not SamplingParams(**sampling).greedy  # (its tokens compared with nothing)
    # Warm-up: connections, channels, graphs, and every point's batch shapes.
    for n in warm_up_sizes(prompts, args.streams):
        run_point(pool, protocol, address, prompts, n, 8, args.clients, args.timeout,
                  sampling=sampling)
    reset_prefix_caches(layout)
    jobs = list(enumerate(fresh_prompts(args.zero_load + 1)))  # no prefix-cache hit
    early = early_starts()
    # hand-overs a decode replica sent ahead of their calls (disaggregated layouts)
    handed = None if colocated(layout) else early_starts("PrefillServer")
    zero = pool.submit(client_process, protocol, address, jobs, 0.0, 2, args.timeout,
                       True).result(timeout=args.timeout + 60)
    ok = [r for r in zero if not r["error"]]
    out.setdefault("zero_load", {})[f"{layout}/{protocol}"] = {
        "ttft_ms": statistics.median([(r["first"] - r["sent"]) * 1e3 for r in ok])
        if ok else float("nan"),
        "errors": len(zero) - len(ok), "hops_ms": breakdown(ok),
        "early_starts": early_since(early),
        "prefill_early_starts": None if handed is None else early_since(handed, "PrefillServer")}
    for n in args.streams:
        out["marks"].append((time.time(), f"{layout} {protocol} {n}"))
        meter = CpuMeter()
        spy = start_py_spy(meter.pid("decode"), args, f"{layout}-{protocol}-{n}")
        meter.start()
        reset_prefix_caches(layout)
        roles = ("DecodeServer",) + (("PrefillServer",) if not colocated(layout) else ())
        before = {role: engine_stats(role) for role in roles}
        early = early_starts()
        records, wall = run_point(pool, protocol, address, prompts, n, args.output_len,
                                  args.clients, args.timeout, args.offsets, sampling)
        rates = {role: engine_rates(before[role], engine_stats(role), wall)
                 for role in roles}
        engine_row = rates["DecodeServer"]
        if spy is not None:
            spy.wait(timeout=60)
        row = {"layout": layout, "protocol": protocol, "streams": n,
               **summarize(records, offline_tokens[n], wall), "cpu": meter.stop(),
               "decode_engine": engine_row, "hops_ms": breakdown(records),
               "prefill_engine": rates.get("PrefillServer"), "early_starts": early_since(early)}
        if sampled:
            row["same_tokens"] = float("nan")
        out["served"].append(row)
        print(f"  {layout} {protocol} {n:4d} streams: {row['tok_s']:9.0f} tok/s, TTFT p50 "
              f"{row['ttft_p50_ms']:.0f} ms, ITL p99 {row['itl_p99_ms']:.1f} ms, "
              f"delay p99 {row['delay_p99_ms']:.1f} ms, "
              f"{row['tokens_per_chunk']:.2f} tok/chunk, errors {row['errors']}, early starts "
              f"{row['early_starts']}",
              flush=True)


def offline_of(out: dict, layout: str) -> tuple[dict, float]:
    """The offline figures a layout is compared with (per stream count) and the engine's time to
    first token alone: the engine split as the layout's replica is."""
    tp = layout_tp(layout)
    if tp > 1:
        split = out["offline_split"][str(tp)]
        return {int(k): v for k, v in split["offline"].items()}, split["engine_ttft_ms"]
    return {int(k): v for k, v in out["offline"].items()}, out["engine_ttft_ms"]


def report(out: dict) -> None:
    off = {int(k): v for k, v in out["offline"].items()}
    mix = out["args"].get("long_prompts")
    print(f"\n{out['model']}: {out['input_len']} in{f' ({mix} long)' if mix else ''} / "
          f"{out['output_len']} out; engine time to "
          f"first token alone {out['engine_ttft_ms']:.1f} ms; {out['device']}")
    print("offline engine: " + ", ".join(
        f"{n}: step {o['step_ms']:.2f} ms, {o['engine_tok_s']:.0f} tok/s stepping"
        for n, o in off.items()))
    print(f"{'layout':11} {'proto':5} {'streams':>7} {'offline':>9} {'served':>9} {'%':>5} "
          f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>7} {'p99':>6} {'delay p50':>9} {'p99':>6} "
          f"{'tok/chk':>7} {'same':>5} "
          f"{'step ms':>7} {'busy':>5} cpu")
    for tp, split in out.get("offline_split", {}).items():
        print(f"offline engine split over {tp} ranks: " + ", ".join(
            f"{n}: {o['tok_s']:.0f} tok/s" for n, o in split["offline"].items())
            + f"; first token alone {split['engine_ttft_ms']:.1f} ms")
    for r in out["served"]:
        o, e = offline_of(out, r["layout"])[0][r["streams"]]["tok_s"], r["decode_engine"]
        cpu = " ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu"].items()))
        print(f"{r['layout']:11} {r['protocol']:5} {r['streams']:7d} {o:9.0f} {r['tok_s']:9.0f} "
              f"{100 * r['tok_s'] / o:5.1f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:7.1f} "
              f"{r.get('itl_p50_ms', float('nan')):7.1f} {r.get('itl_p99_ms', float('nan')):6.1f} "
              f"{r['delay_p50_ms']:9.1f} {r['delay_p99_ms']:6.1f} {r['tokens_per_chunk']:7.2f} "
              f"{r['same_tokens']:5.2f} {e['step_ms']:7.2f} {e['busy']:5.2f} {cpu}")
    for r in out["served"]:
        for n, t in (r.get("ttft_by_len") or {}).items():
            print(f"  TTFT of {n}-token prompts, {r['layout']} {r['protocol']} {r['streams']}: "
                  f"p50 {t['ttft_p50_ms']:.0f} ms, p99 {t['ttft_p99_ms']:.0f} ms "
                  f"({t['requests']} requests)")
    for r in out["served"]:
        if r["hops_ms"]:
            hops = ", ".join(f"{k} {v:.1f}" for k, v in r["hops_ms"].items())
            print(f"  TTFT hops (median ms), {r['layout']} {r['protocol']} {r['streams']}: {hops}")
    for r in out["served"]:
        if (e := r["decode_engine"]).get("prompt_steps"):
            print(f"  decode engine, {r['layout']} {r['protocol']} {r['streams']}: "
                  f"{e['prompt_steps']} of {e['steps']} steps carried prompt tokens, "
                  f"{e['prompt_step_ms']:.1f} ms each (the others {e['other_step_ms']:.1f} ms)")
    for r in out["served"]:
        if p := r.get("prefill_engine"):
            print(f"  prefill engine, {r['layout']} {r['protocol']} {r['streams']}: "
                  f"{p['steps']} steps of {p['scheduled_per_step']:.0f} tokens, "
                  f"{p['step_ms']:.1f} ms each, busy {p['busy']:.2f} of the point's wall time")
    print("\nzero load (served TTFT - engine time to first token; where the time goes, ms):")
    for key, z in out.get("zero_load", {}).items():
        engine_ttft = offline_of(out, key.split("/")[0])[1]
        hops = ", ".join(f"{k} {v:.2f}" for k, v in z["hops_ms"].items())
        early = z.get("early_starts") or {}
        handed = z.get("prefill_early_starts")
        handed = "" if handed is None else (f", hand-overs started early claimed "
                                           f"{handed.get('claimed', 0)} dropped "
                                           f"{handed.get('dropped', 0)}")
        print(f"  {key:12} TTFT {z['ttft_ms']:.1f} ms, added "
              f"{z['ttft_ms'] - engine_ttft:.1f} ms, early starts claimed "
              f"{early.get('claimed', 0)} dropped {early.get('dropped', 0)}{handed}  [{hops}]")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rate", type=float, default=None,
                   help="send each point's requests at this Poisson rate (req/s) instead of all "
                   "at once: latencies at a load both layouts carry (tok/s then follows the rate)")
    p.add_argument("--long-prompts", default=None, metavar="FRACTION:TOKENS",
                   help="a mixed load: every round(1/FRACTION)-th prompt has TOKENS tokens "
                   "(0.2:4096: 20%% of 4k-token prompts, the others --input-len)")
    p.add_argument("--streams", default="1,16,64,256")
    p.add_argument("--layouts", default="colo,1p1d")
    p.add_argument("--protocols", default="http,grpc",
                   help="http, grpc, http-untimed, grpc-untimed (without asking for the "
                        "timings)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="of the requests, the warm-up's too (the zero-load ones stay greedy); "
                        "above 0 the 'same' column is nan")
    p.add_argument("--top-k", type=int, default=-1, help="of the requests (-1: none)")
    p.add_argument("--top-p", type=float, default=1.0, help="of the requests (1: none)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=JSON",
                   help="an EngineConfig field for every engine, offline and served "
                        "(e.g. cuda_graph_max_tokens=0); repeatable")
    p.add_argument("--served-engine-option", action="append", default=[], metavar="KEY=JSON",
                   help="an EngineConfig field for the served engines alone, the offline "
                        "reference keeping its own (e.g. speculative_config={...}: the served "
                        "tokens with speculation against the offline ones without); repeatable")
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--colo-gpus", type=float, default=None, help="GPUs of the colocated replica "
                   "(default: 1 with a GPU, 0 without)")
    p.add_argument("--gpus-per-role", type=float, default=None,
                   help="GPUs of each 1P1D replica (default: 0.5 with a GPU, 0 without)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--push-at-step-end", action="store_true",
                   help="transfer.push_at_step_end: prefill replicas start each push as the "
                        "prefilling step returns")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="disaggregation.itl_target_ms of every disaggregated layout")
    p.add_argument("--disaggregation", choices=["always", "auto", "never"], default="always",
                   help="where a disaggregated layout prefills each request (always: every "
                        "request handed over, what the layout's name says; auto: the app's "
                        "default, short prompts prefilled on the decode replica)")
    p.add_argument("--role-cpus", type=float, default=None,
                   help="CPUs Ray reserves per engine replica (default: 1 with a GPU, else 0.5)")
    p.add_argument("--routers", type=int, default=None, help="ingress replicas")
    p.add_argument("--clients", type=int, default=None, help="client processes")
    p.add_argument("--zero-load", type=int, default=8, help="single requests for zero-load TTFT")
    p.add_argument("--no-early-start", action="store_true",
                   help="router.early_start off: requests start when their Serve calls arrive")
    p.add_argument("--no-http-fast-path", action="store_true",
                   help="router.http_fast_path off: generation requests through FastAPI's routing")
    p.add_argument("--stub-forward", action="store_true")
    p.add_argument("--cpu", action="store_true",
                   help="on a GPU host, the CPU configuration: every engine on the CPU")
    p.add_argument("--plain-ray", action="store_true",
                   help="start Ray without Baton's settings (Serve's Python proxy, no "
                        "throughput profile), as on a Ray the user started")
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the replicas' start-up heap to the garbage collector")
    p.add_argument("--py-spy", type=int, default=0,
                   help="seconds of py-spy (GIL holders) on the decode replica per point")
    p.add_argument("--profile-dir", default="results/serving-profile")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None)
    p.add_argument("--dashboard", default=None, metavar="PNG",
                   help="draw deploy/grafana/baton.json from Ray's metrics export over the run")
    p.add_argument("--rate-window", type=float, default=10.0,
                   help="seconds of the dashboard's rate() window")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    if args.stub_forward and gpu:
        raise SystemExit("--stub-forward is for CPU runs (on a GPU host: --cpu)")
    args.streams = [int(s) for s in args.streams.split(",")]
    args.protocols = args.protocols.split(",")
    cpus = os.cpu_count() or 2
    args.colo_gpus = (1.0 if gpu else 0.0) if args.colo_gpus is None else args.colo_gpus
    args.gpus_per_role = (0.5 if gpu else 0.0) if args.gpus_per_role is None \
        else args.gpus_per_role
    args.role_cpus = args.role_cpus or (1.0 if gpu else 0.5)
    args.routers = args.routers or max(1, min(4, cpus // 4))
    args.clients = args.clients or max(1, min(8, cpus // 2))
    engine = {"model": args.model, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "show_progress": False,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if args.num_blocks:
        engine["num_blocks"] = args.num_blocks
    if args.cpu:
        engine["device"] = "cpu"
    if gpu:
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.stub_forward:
        stub_forward()
        engine["enforce_eager"] = True
    engine.update(_key_json(args.engine_option))
    served_engine = served_config(engine, args.served_engine_option)

    g = torch.Generator().manual_seed(0)
    from engine.model_source import resolve_model
    vocab = min(resolve_model(args.model).config.vocab_size, 150000)
    prompts = torch.randint(10, vocab, (max(args.streams), args.input_len), generator=g).tolist()
    # An open loop: Poisson send times, the same for every point and layout.
    args.offsets = workloads.arrival_offsets(args.rate, max(args.streams)) if args.rate else None
    for i, length in workloads.long_prompts(args.long_prompts, len(prompts)).items():
        prompts[i] = torch.randint(10, vocab, (length,), generator=g).tolist()  # a long one

    def fresh_prompts(n: int) -> list[list[int]]:
        return torch.randint(10, vocab, (n, args.input_len), generator=g).tolist()

    t0 = time.time()
    offline_kw = dict(engine)
    if gpu and args.colo_gpus:
        offline_kw["gpu_memory_utilization"] = args.gpu_memory_utilization * args.colo_gpus
    off, offline_tokens, engine_ttft = offline_runs(offline_kw, prompts, args.streams,
                                                    args.output_len, fresh_prompts(args.zero_load),
                                                    sampling_of(args))
    print(f"offline ({time.time() - t0:.0f}s): " + ", ".join(f"{n}: {v['tok_s']:.0f} tok/s"
                                                              for n, v in off.items()), flush=True)
    out = {"model": args.model, "input_len": args.input_len, "output_len": args.output_len,
           "device": torch.cuda.get_device_name() if gpu else f"CPU ({cpus} cores)",
           "date": time.strftime("%Y-%m-%d"), "args": {k: v for k, v in vars(args).items()},
           "offline": off, "engine_ttft_ms": engine_ttft, "served": [], "marks": []}
    layouts = args.layouts.split(",")
    tokens_by_tp = {1: offline_tokens}
    for tp in sorted({layout_tp(x) for x in layouts} - {1}):
        t0 = time.time()
        split_off, tokens_by_tp[tp], split_ttft = offline_runs(
            {**offline_kw, "tensor_parallel_size": tp}, prompts, args.streams, args.output_len,
            fresh_prompts(args.zero_load), sampling_of(args))
        out.setdefault("offline_split", {})[str(tp)] = {"offline": split_off,
                                                        "engine_ttft_ms": split_ttft}
        print(f"offline split over {tp} ranks ({time.time() - t0:.0f}s): " + ", ".join(
            f"{n}: {v['tok_s']:.0f} tok/s" for n, v in split_off.items()), flush=True)

    from deploy import ray_env
    env_vars = {}
    if args.stub_forward:
        env_vars["BENCH_STUB_FORWARD"] = "1"
    if args.switch_interval:
        env_vars["BENCH_SWITCH_INTERVAL"] = str(args.switch_interval)
    if args.no_gc_freeze:
        env_vars["BATON_GC_FREEZE"] = "0"
    metrics = {}
    if args.dashboard:  # Ray's export on a port of ours, reported every second
        metrics = {"_metrics_export_port": ray_env.free_port(),
                   "_system_config": {"metrics_report_interval_ms": 1000}}
    with local_ray(max(4, cpus), env_vars, plain=args.plain_ray, runtime_env={
            "worker_process_setup_hook": "benchmarks.serving_bench.worker_setup"},
            **metrics) as settings:
        out["ray_env"] = settings
        serve_layouts(args, layouts, served_engine, prompts, tokens_by_tp, fresh_prompts, out,
                      metrics.get("_metrics_export_port"))
    report(out)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _key_json(options: list[str]) -> dict:
    """``KEY=JSON`` options as a dict."""
    return {key: json.loads(value) for key, _, value in (o.partition("=") for o in options)}


def served_config(engine: dict, options: list[str]) -> dict:
    """The served engines' fields: the offline reference's ``engine`` with ``--served-engine-
    option``s over it (``engine`` itself unchanged)."""
    return {**engine, **_key_json(options)}


def serve_layouts(args, layouts, engine, prompts, tokens_by_tp, fresh_prompts, out,
                  metrics_port) -> None:
    """Every layout in turn on the local Ray, the clients in a pool of processes; with
    ``--dashboard``, the run's panels drawn afterwards."""
    pool = ProcessPoolExecutor(args.clients, mp_context=get_context("spawn"))
    recorder = None
    if args.dashboard:
        from benchmarks.dashboard import Recorder
        recorder = Recorder(metrics_port).start()
    try:
        for layout in layouts:
            serve_layout(layout, layout_config(layout, engine, args), args, pool, prompts,
                         tokens_by_tp[layout_tp(layout)], fresh_prompts, out)
    finally:
        pool.shutdown(cancel_futures=True)
        if recorder is not None:
            time.sleep(3)  # the last reports reach the export
            from benchmarks.dashboard import render
            os.makedirs(os.path.dirname(os.path.abspath(args.dashboard)), exist_ok=True)
            render(recorder.stop(), args.dashboard, rate_window_s=args.rate_window,
                   marks=out["marks"], title=f"{args.model} {args.input_len} in / "
                   f"{args.output_len} out, {out['device']}, {out['date']}")


if __name__ == "__main__":
    main()
