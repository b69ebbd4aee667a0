"""The ingress's request service, the same for both protocols: a request from its token ids and
sampling parameters to its end. It runs the engine's own checks (:mod:`engine.validation`:
the prompt against the vocabulary and the context, stop strings) and the model's name, starts
the request on a decode replica (:class:`~router.ingress.streams.DecodeClient`), fans a
request out into its ``n``/``best_of`` sequences and a batch into its prompts (:class:`Merged`),
keeps the request's metrics and logs its timeline. The HTTP (OpenAI) and gRPC
adapters (:mod:`router.ingress.http`, :mod:`router.ingress.grpc_api`) only translate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict

from ray.serve.exceptions import BackPressureError

from contracts.messages import TIMELINE, GenerateResult, timeline
from contracts.metrics import replica_id
from contracts.role import ReplicaCount
from engine.sampling_params import SamplingParams, fan_out
from engine.model_source import load_tokenizer, resolve_model
from engine.quantization import resolve_scheme
from engine.errors import BadRequest
from engine.validation import RequestChecks
from engine.generation_config import log_defaults, sampling_defaults
from router.config import RouterConfig
from router.ingress.errors import NotStarted, RequestTimeout, UnknownModel
from router.ingress.logprobs import TokenTexts
from router.ingress.metrics import RouterMetrics
from router.ingress.prompts import PromptEncoder
from router.ingress.protocol import ChatCompletionRequest, CompletionRequest
from router.ingress.streams import DecodeClient, RequestStream

API_KEY_ENV = "BATON_API_KEY"


def transfer_of(result: GenerateResult | None) -> dict | None:
    if result is None or result.transfer is None:
        return None
    t = result.transfer
    return {"bytes": t.bytes, "blocks_sent": t.blocks_sent, "blocks_skipped": t.blocks_skipped,
            "seconds": t.seconds, "backend": t.backend, "src_node": t.src_node,
            "dst_node": t.dst_node, "prefill_seconds": result.prefill_seconds}


def usage_of(streams: list[RequestStream], results: list[GenerateResult | None],
           per_prompt: int = 1) -> dict:
    """Usage of one request, summed over its sequences (``per_prompt`` of each prompt: its
    prompt counts once, as OpenAI counts it); ``kv_transfer`` one per sequence when several."""
    firsts = streams[::per_prompt]
    n_in = sum(s.num_prompt_tokens for s in firsts)
    n_out = sum(len(s.token_ids) for s in streams)
    transfers = [transfer_of(r) for r in results]
    prefilled = [{"where": r.prefilled_where, "reason": r.prefilled_why} if r is not None
                 else None for r in results]
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens
                                                           for s in firsts)},
            "kv_transfer": transfers[0] if len(transfers) == 1 else transfers,
            "prefilled": prefilled[0] if len(prefilled) == 1 else prefilled}


def log_timeline(stream: RequestStream, outcome: str, ingress: str) -> None:
    """One line per request at the ingress; the decode replica logs its own under the same id
    (``<id>~<n>`` after the n-th migration)."""
    names = replicas_of(stream.result, ingress)
    TIMELINE.info("request %s ingress: %s, %d prompt + %d output tokens, %d migrations; "
                  "decode %s, prefill %s; %s", stream.request_id, outcome,
                  stream.num_prompt_tokens, len(stream.token_ids), stream.migrations,
                  names["decode"] or "-", names["prefill"] or "-",
                  timeline(**dict(phases(stream, stream.result))))


def phases(stream: RequestStream, result: GenerateResult | None) -> list[tuple[str, float]]:
    """The request's milestones across the roles, in the order they happened (``time.time()``
    of each replica's host: on several nodes, as far apart as their clocks). A hand-over's
    first token may come ahead of its push and admission (docs/serving.md)."""
    t, d = stream.timing, result.timing if result is not None else None
    p = d.prefill if d is not None else None
    marks = [("arrived", t.arrived), ("received", t.received), ("submitted", t.submitted)]
    if d is not None:
        marks += [("decode_received", d.received), ("prefill_called", d.prefill_called),
                  ("reserved", d.reserved), ("first_arrived", d.first_arrived)]
    if p is not None:  # ``added`` and ``sampled``: the prefill replica's engine thread
        marks += [("prefill_received", p.received), ("prefill_added", p.added),
                  ("prefill_sampled", p.sampled), ("prefilled", p.prefilled),
                  ("pushed", p.pushed)]
    if d is not None:
        marks += [("prefill_returned", d.prefill_returned),
                  ("admitted" if p is not None else "queued", d.queued),
                  ("decode_first_token", d.first_token)]
    marks += [("first_token", t.first_token)]
    marks += [(f"moved{i + 1}", at) for i, at in enumerate(stream.moved_at)]
    marks += [("finished", t.finished or time.time())]
    return sorted([(name, at) for name, at in marks if at], key=lambda m: m[1])


def replicas_of(result: GenerateResult | None, ingress: str) -> dict:
    d = result.timing if result is not None else None
    return {"ingress": ingress, "decode": d.replica if d is not None else None,
            "prefill": d.prefill.replica if d is not None and d.prefill is not None else None}


def timing_of(stream: RequestStream, result: GenerateResult | None, ingress: str) -> dict:
    return {"phases": [[name, at] for name, at in phases(stream, result)],
            "replicas": replicas_of(result, ingress), "router": asdict(stream.timing),
            "decode": asdict(result.timing) if result is not None else None}


class Merged:
    """The chunks of one sequence, or of several as they come: ``(index, chunk)``; ``items``
    are ``(prompt ids, one-sequence params)``, a batch's prompts each fanned out into its ``n``
    (or ``best_of``) sequences. One sequence is followed directly (the hot path); several are
    all started here and each is read by a task of its own, the chunks meeting in a queue.
    ``streams`` are the sequences' streams once started, ``results`` their replicas' results
    once all have ended; ``aclose`` stops what still runs (a client that left, a failed
    batch)."""

    def __init__(self, router: RequestService, items: list[tuple[list[int], SamplingParams]],
                 rids: list[str]):
        self.router, self.items, self.rids = router, items, rids
        self.streams: list[RequestStream] = []
        self.results: list[GenerateResult | None] = []
        self._tasks: list[asyncio.Future] = []
        self._chunks = self._follow()

    def __aiter__(self):
        return self._chunks

    async def _follow(self):
        if len(self.items) == 1:
            (ids, params), = self.items
            async with self.router.request(ids, params, self.rids[0]) as stream:
                self.streams = [stream]
                async for chunk in stream.chunks(stream.deadline):
                    yield 0, chunk
                self.streams, self.results = [stream], [await self.router.finish(stream)]
            return
        async with AsyncExitStack() as stack:
            # Each under a Serve request id of its own (``in_batch``; see DecodeClient._submit).
            streams = [await stack.enter_async_context(
                self.router.request(ids, params, rid, in_batch=True))
                for (ids, params), rid in zip(self.items, self.rids)]
            self.streams = streams
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: RequestStream) -> None:
                try:
                    async for chunk in stream.chunks(stream.deadline):
                        queue.put_nowait((i, chunk, None))
                    queue.put_nowait((i, None, None))
                except Exception as exc:  # noqa: BLE001 - the reader raises it
                    queue.put_nowait((i, None, exc))

            self._tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
            live = len(streams)
            while live:
                i, chunk, exc = await queue.get()
                if exc is not None:
                    raise exc
                if chunk is None:
                    live -= 1
                    continue
                yield i, chunk
            self.streams = streams
            self.results = [await self.router.finish(st) for st in streams]

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self._chunks.aclose()  # leaves the ``request`` contexts now, not at collection


def warn_if_open_without_key(api_key: str | None) -> None:
    """Say so loudly, at start, when the app listens beyond this machine with no API key."""
    if api_key:
        return
    try:
        from ray.serve.context import _get_global_client
        host = _get_global_client().http_config.host
    except Exception:  # noqa: BLE001 - not under a Serve controller (tests driving the class)
        return
    if host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("ray.serve").warning(
            "WARNING: the HTTP port listens on %s (beyond this machine) with no API key: anyone "
            "who reaches it can use the model. Set BATON_API_KEY or router.api_key.", host)


def per_decode_replica(max_ongoing: int | None, max_queued: int | None) -> int | None:
    """What one decode replica holds: its ongoing and queued bounds (None: no bound, for a
    queue of ``-1``, which Serve leaves unbounded)."""
    if max_queued == -1:
        return None
    return (max_ongoing or 0) + max(0, max_queued or 0)


class RequestService:
    """One ingress replica's requests, whichever protocol they came in by. The protocol adapters
    hold one (:class:`~router.ingress.http.HttpAdapter`, :class:`~router.ingress.grpc_api.
    GrpcAdapter`) and only translate."""

    def __init__(self, decode, model: str, served_name: str, max_model_len: int | None,
                 config: dict | None = None, engine: dict | None = None, fallback=None):
        """``fallback``: the prefill deployment's handle in a disaggregated app (whole requests
        go there while no decode replica answers, :class:`~router.ingress.streams.
        DecodeClient`)."""
        import ray

        cfg = RouterConfig(**(config or {}))
        self.api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
        self.max_request_bytes = cfg.max_request_bytes
        self.http_fast_path = cfg.http_fast_path

        source = resolve_model(model)
        self.tokenizer = load_tokenizer(source)
        self.texts = TokenTexts(self.tokenizer)
        self.client = DecodeClient(decode, self.tokenizer, ray.util.get_node_ip_address(),
                                   fallback=fallback, queue_timeout_s=cfg.queue_timeout_s,
                                   retry_after_s=cfg.retry_after_s,
                                   decode_max_ongoing=cfg.decode_max_ongoing,
                                   early_start=cfg.early_start)
        self.vocab_size = source.config.vocab_size
        self.max_model_len = min(max_model_len or source.config.max_position_embeddings,
                                 source.config.max_position_embeddings)
        self.prompts = (PromptEncoder(self.tokenizer, self.max_model_len)
                        if self.tokenizer is not None else None)
        self.checks = RequestChecks(served_name, self.vocab_size, self.max_model_len,
                                    self.tokenizer is not None)
        self.served_name = served_name
        engine = engine or {}  # what the replicas run, said in /v1/models
        scheme = resolve_scheme(source.config.quantization, engine.get("quantization"), model)
        self.card_extras = {"quantization": scheme.name if scheme else None,
                            "kv_cache_dtype": engine.get("kv_cache_dtype", "auto")}
        self.timeout_s = cfg.request_timeout_s
        self.first_token_timeout_s = cfg.first_token_timeout_s
        self.max_sequences = cfg.max_sequences_per_request
        self.default_max_tokens = cfg.max_tokens_default
        self.sampling_defaults = sampling_defaults(
            source.path, engine.get("generation_config", "auto"),
            engine.get("override_generation_config"))
        log_defaults(self.sampling_defaults, "ingress")
        self.reasoning_parser = cfg.reasoning_parser
        self.replica = replica_id()
        self.metrics = RouterMetrics()
        self.decode = decode
        self.retry_after_s = cfg.retry_after_s
        self._decode_replicas = ReplicaCount(decode) if cfg.early_refusal \
            and cfg.decode_max_ongoing else None
        self._per_decode_replica = per_decode_replica(cfg.decode_max_ongoing,
                                                      cfg.decode_max_queued)
        self._ingress_replicas = cfg.num_replicas

    def pool_bound(self) -> int | None:
        """What the decode pool holds (its live replicas' ongoing and queued bounds): the app's
        bound on open generation requests, which HAProxy refuses beyond (.haproxy); None while
        no decode replica is listed (or early refusal is off): every request goes in."""
        if self._decode_replicas is None or self._per_decode_replica is None \
                or not (n := self._decode_replicas.value):
            return None
        return n * self._per_decode_replica

    def open_limit(self) -> int | None:
        """This replica's share of :meth:`pool_bound`, the door's bound on open generation
        requests (None: none)."""
        if (bound := self.pool_bound()) is None:
            return None
        return -(-bound // self._ingress_replicas)

    async def prompt_ids(self, prompt) -> list[int]:
        """Token ids of a text (tokenized off the event loop when long) or of an id list."""
        if isinstance(prompt, str):
            self.checks.text()
            return self.checks.prompt(await self.prompts.encode(prompt))
        return self.checks.prompt(list(prompt))

    async def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.prompts is None or not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"messages: model {self.served_name!r} has no chat template")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] \
            if body.tool_mode != "none" else None
        return self.checks.prompt(await self.prompts.render_chat(
            [m.for_template() for m in body.messages], tools=tools,
            template_kwargs=body.chat_template_kwargs))

    @asynccontextmanager
    async def request(self, ids: list[int], params: SamplingParams, request_id: str,
                      in_batch: bool = False):
        """A started request, with its metrics; a writer that leaves cancels it."""
        received, start = time.time(), time.monotonic()
        metrics = self.metrics

        def on_token(gap: float | None, _produced_at: float) -> None:
            if gap is None:
                metrics.ttft.observe(time.monotonic() - start)
            else:
                metrics.itl.observe(gap)

        stream = await self.client.start(ids, params, request_id, on_token, received,
                                         own_serve_id=in_batch)
        stream.deadline = start + self.timeout_s
        if self.first_token_timeout_s is not None:
            stream.start_by = start + self.first_token_timeout_s
        metrics.in_flight.inc()
        outcome = "error"
        try:
            yield stream
            outcome = stream.finish_reason or "error"
        except RequestTimeout:
            outcome = "timeout"
            raise
        except NotStarted:
            outcome = "refused"
            raise
        except BackPressureError:
            outcome = "refused"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"  # the client went away
            raise
        finally:
            self.client.close(stream)
            metrics.in_flight.dec()
            metrics.requests.labels(outcome).inc()
            metrics.tokens.inc(len(stream.token_ids))
            metrics.migrations.inc(stream.migrations)
            metrics.e2e.observe(time.monotonic() - start)
            log_timeline(stream, outcome, self.replica)

    async def finish(self, stream: RequestStream) -> GenerateResult | None:
        """The decode replica's result (usage, transfer stats for the answer's usage)."""
        return await self.client.result(stream)

    async def ready(self, timeout_s: float = 2.0) -> bool:
        """A decode replica answers a trivial call within ``timeout_s``."""
        try:
            await asyncio.wait_for(self.decode.kv_load.remote(), timeout_s)
        except Exception:  # noqa: BLE001 - none placed, none running, or one failing
            return False
        return True

    def model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "owned_by": "baton", "created": 0,
                "max_model_len": self.max_model_len, **self.card_extras}

    def check_model(self, name: str | None) -> None:
        """:class:`UnknownModel` when a request names a model this app does not serve."""
        if name and name != self.served_name:
            raise UnknownModel(f"model {name!r} does not exist; this server serves "
                               f"{self.served_name!r}")

    async def completion_inputs(self, body: CompletionRequest):
        """One prompt or a batch (text or ids), ``best_of``; with ``echo``, each prompt's text."""
        prompts = body.prompts()
        batch = [await self.prompt_ids(p) for p in prompts]
        params = body.sampling_params(self.default_max_tokens, body.logprobs, body.best_of,
                                     self.sampling_defaults)
        echo = [p if isinstance(p, str) else self._text(ids)
                for p, ids in zip(prompts, batch)] if body.echo else None
        return batch, params, echo

    async def chat_inputs(self, body: ChatCompletionRequest):
        """One prompt, the messages through the chat template; a forced tool call's grammar."""
        ids = await self.chat_ids(body)
        params = body.sampling_params(self.default_max_tokens, body.logprobs_asked,
                                     defaults=self.sampling_defaults)
        if (calls := body.tool_grammar()) is not None:  # required / a named function
            params = params.model_copy(update={"structured_output": calls})
        return [ids], params, None

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def checked_inputs(self, inputs, body):
        """``inputs(body)`` (``batch, params, echo``) with the engine's own checks
        (:mod:`engine.validation`) and the context bound done here, before any replica sees
        the request. A structured output is compiled (and a bad one refused) where it is used:
        on the decode replica (and the prefill replica that samples the first token)."""
        batch, params, echo = await inputs(body)
        if len(batch) * params.num_sequences > self.max_sequences:
            raise BadRequest(f"n/best_of: {len(batch)} prompts x {params.num_sequences} "
                             f"sequences exceed this server's {self.max_sequences} sequences "
                             "per request")
        self.checks.params(params)
        for ids in batch:
            self.checks.fits(len(ids), params)
        return batch, params, echo

    def feed(self, batch, params: SamplingParams, rid: str) -> Merged:
        """Every sequence of the request, prompt by prompt (``num_sequences`` each), merged;
        one sequence keeps the request's id, several get ``<id>-<i>``."""
        children = fan_out(params)
        items = [(ids, child) for ids in batch for child in children]
        n = len(items)
        return Merged(self, items, [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)])
