"""Baton's command line: serve Qwen3 with prefill and decode disaggregated on Ray Serve.

  baton demo              1 prefill + 1 decode on a local Ray of its own; a few requests
  baton serve MODEL       serve a model (a folder, a Hugging Face repo id in the local cache,
                          dummy:Qwen3-<size> or tiny) on a local Ray until Ctrl-C
  baton serve CONFIG      the same for a Serve config file (as `serve deploy` would)
  baton generate PROMPT   offline generation with the engine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from deploy.ray_env import LOOPBACK, free_port
from loadtests import sse

DEMO_PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small engine",
    "Question: what is two plus two? Answer:",
]
GRPC_SERVICER = "proto.servicer.add_to_server"


# -- offline --------------------------------------------------------------------------------
def cmd_generate(args) -> None:
    from engine import LLM, SamplingParams

    prompts = [[int(t) for t in p.split(",")] if args.token_ids else p for p in args.prompt]
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    print(f"loaded {args.model} on {llm.engine.device} ({llm.engine.dtype}, weights "
          f"{llm.engine.weights_name}, KV cache {str(llm.engine.runner.kv_dtype)[6:]}) in "
          f"{time.perf_counter() - t0:.1f}s")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        shown = out.text if out.text is not None else out.token_ids
        print(f"\n> {prompt!r}\n  {shown!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{total} tokens in {elapsed:.2f}s: {total / elapsed:.1f} tokens/s")


# -- serving --------------------------------------------------------------------------------
def _start_ray(num_cpus: int | None = None, address: str | None = None,
               host: str = "127.0.0.1") -> None:
    """A local Ray of this command's own, or the cluster at ``address``; ``host``: where the
    app's HTTP port listens (``deploy.ray_env.init_ray``)."""
    from deploy import ray_env

    ray_env.init_ray(address, num_cpus, host)


def _demo_config(gpu: bool) -> dict:
    # The demo shows the hand-over, so every prompt goes to the prefill replica (its short
    # prompts would be prefilled on the decode replica under the default, auto).
    always = {"disaggregation": {"mode": "always"}}
    if gpu:  # two replicas on one GPU, CUDA IPC between them
        return {"mode": "disaggregated",
                "engine": {"model": "dummy:Qwen3-0.6B", "gpu_memory_utilization": 0.35,
                           "max_num_seqs": 16},
                "prefill": {"num_gpus": 0.5, "num_cpus": 0.5},
                "decode": {"num_gpus": 0.5, "num_cpus": 0.5},
                "transfer": {"backend": "cuda_ipc"}, **always}
    return {"mode": "disaggregated", "engine": {"model": "tiny", "num_blocks": 512,
                                                "max_num_seqs": 16}, **always}


def cmd_demo(args) -> None:
    import requests
    import torch
    from ray import serve

    from deploy.app import build_app

    gpu = torch.cuda.is_available() and not args.cpu
    config = _demo_config(gpu)
    config["engine"].update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    prompts = DEMO_PROMPTS if not gpu else [[1, 2, 3, 4] * 8, [5, 6, 7] * 20]
    print(f"starting local Ray and Serve: 1 prefill + 1 decode, {config['engine']['model']} on "
          f"{'GPU' if gpu else 'CPU'} ...", flush=True)
    _start_ray(num_cpus=max(4, os.cpu_count() or 1))
    http, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER],
                              "enable_reflection": False})
    t0 = time.perf_counter()
    serve.run(build_app(config), name="baton", route_prefix="/", blocking=False)
    watch_startup(["baton"], timeout=args.timeout)
    wait_ready(f"http://127.0.0.1:{http}", timeout=args.timeout)
    print(f"ready in {time.perf_counter() - t0:.1f}s: http://127.0.0.1:{http}, "
          f"gRPC 127.0.0.1:{grpc_port}\n")
    if not gpu:
        print("tiny has random weights: its text is noise (shown with its token ids); the "
              "JSON example shows a grammar at work\n")
    try:
        for prompt in prompts:
            _demo_http(f"http://127.0.0.1:{http}", prompt, args.max_tokens, args.timeout,
                       requests)
        if not gpu:  # dummy models on a GPU have no tokenizer, hence no grammar
            _demo_json(f"http://127.0.0.1:{http}", args.timeout, requests)
        _demo_grpc(f"127.0.0.1:{grpc_port}", prompts[0], args.max_tokens, args.timeout)
    finally:
        serve.shutdown()
        import ray
        ray.shutdown()
    print("\ndone")


def startup_summary(status, apps: list[str]) -> tuple[str, str | None]:
    """One line on the applications' start-up (each deployment's replicas running of all, and
    the states of the others) from ``serve.status()``, and a failure message if one failed."""
    parts, failed = [], None
    for name in apps:
        app = status.applications.get(name)
        if app is None:
            parts.append(f"{name}: not deployed yet")
            continue
        deps = []
        for dep_name, dep in app.deployments.items():
            states = {str(getattr(k, "value", k)): n for k, n in dep.replica_states.items()}
            running, total = states.pop("RUNNING", 0), sum(states.values())
            others = ", ".join(f"{n} {k.lower()}" for k, n in sorted(states.items()) if n)
            deps.append(f"{dep_name} {running}/{running + total}" + (f" ({others})" if others
                                                                      else ""))
        state = str(getattr(app.status, "value", app.status))
        parts.append(f"{name} {state.lower()}: " + ", ".join(deps))
        if state == "DEPLOY_FAILED":
            failed = f"{name}: {app.message}"
    return "; ".join(parts), failed


def watch_startup(apps: list[str], timeout: float, interval_s: float = 0.5) -> None:
    """Print the start-up of Serve applications as it goes (a line whenever a replica changes
    state: loading weights and capturing graphs take minutes on a big model) until every one
    is running; SystemExit on a failed deployment, TimeoutError after ``timeout`` s."""
    from ray import serve

    t0, last = time.perf_counter(), None
    while time.perf_counter() - t0 < timeout:
        status = serve.status()
        line, failed = startup_summary(status, apps)
        if line != last:
            print(f"[{time.perf_counter() - t0:6.1f}s] {line}", flush=True)
            last = line
        if failed:
            raise SystemExit(f"deployment failed: {failed}")
        if all(a in status.applications and
               str(getattr(status.applications[a].status, "value", "")) == "RUNNING"
               for a in apps):
            return
        time.sleep(interval_s)
    raise TimeoutError(f"the applications did not start within {timeout}s: {last}")


def wait_ready(url: str, timeout: float) -> None:
    """Wait until the app at ``url`` answers ``/health`` (TimeoutError after ``timeout`` s)."""
    import requests
    end = time.time() + timeout
    while time.time() < end:
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the app did not answer /health within {timeout}s")


def _readable(text: str) -> str:
    """Text as it can be read: control characters and undecodable bytes shown escaped."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode()
                   for c in text)


def _demo_http(url: str, prompt, max_tokens: int, timeout: float, requests) -> None:
    t0 = time.perf_counter()
    resp = requests.post(f"{url}/v1/completions", stream=True, timeout=timeout,
                         json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}})
    resp.raise_for_status()
    print(f"HTTP > {prompt!r}\n  ", end="", flush=True)
    ttft, usage, ids = None, None, []
    for event in sse.events(resp.iter_lines()):
        if (error := sse.failure(event)) is not None:
            raise RuntimeError(error)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            if choice["token_ids"] and ttft is None:
                ttft = time.perf_counter() - t0
            ids += choice["token_ids"]
            shown = _readable(choice["text"]) if isinstance(prompt, str) else \
                "".join(f"[{t}]" for t in choice["token_ids"])
            print(shown, end="", flush=True)
    if isinstance(prompt, str):
        print(f"\n  token ids: {ids}", end="")
    moved = usage["kv_transfer"] or {}
    print(f"\n  TTFT {ttft * 1e3:.1f} ms, {usage['completion_tokens']} tokens in "
          f"{time.perf_counter() - t0:.2f}s; KV moved: {moved.get('bytes', 0) / 1e6:.2f} MB in "
          f"{moved.get('blocks_sent', 0)} blocks ({moved.get('blocks_skipped', 0)} skipped), "
          f"{moved.get('seconds', 0) * 1e3:.2f} ms over {moved.get('backend', '-')}\n")


DEMO_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False}


def _demo_json(url: str, timeout: float, requests) -> None:
    """A structured output: JSON of a schema, compact (no whitespace to pad with), parsed."""
    resp = requests.post(f"{url}/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": DEMO_SCHEMA}},
        "structured_outputs": {"disable_any_whitespace": True}})
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    content = choice["message"]["content"]
    print(f"HTTP chat, JSON of a schema > {content}  ({choice['finish_reason']}; parses to "
          f"{json.loads(content)})\n" if choice["finish_reason"] == "stop" else
          f"HTTP chat, JSON of a schema > {_readable(content)} (cut at max_tokens)\n")


def _demo_grpc(address: str, prompt, max_tokens: int, timeout: float) -> None:
    import grpc

    from proto import baton_pb2, baton_pb2_grpc

    fields = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    req = baton_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                    **fields)
    with grpc.insecure_channel(address) as channel:
        stub = baton_pb2_grpc.BatonStub(channel)
        print(f"gRPC GenerateStream > {prompt!r}\n  ", end="", flush=True)
        last = None
        for msg in stub.GenerateStream(req, timeout=timeout):
            shown = _readable(msg.text) if isinstance(prompt, str) else \
                "".join(f"[{t}]" for t in msg.token_ids)
            print(shown, end="", flush=True)
            last = msg
        print(f"\n  TTFT {last.ttft_s * 1e3:.1f} ms, {last.usage.completion_tokens} tokens, "
              f"finish: {last.finish_reason}")


def serve_config_from_flags(args) -> dict:
    """The Serve config (as a YAML file would hold it) that ``baton serve MODEL`` runs."""
    import torch

    gpus = torch.cuda.device_count()
    ranks = args.tensor_parallel_size
    replicas = (args.decode + args.prefill) * ranks
    per_replica = args.gpus_per_replica
    if per_replica is None:  # share what there is: a GPU each (per rank), or shares of one
        per_replica = min(1.0, gpus / replicas) if gpus else 0.0
    engine = {"model": args.model, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype}
    if ranks > 1:
        engine["tensor_parallel_size"] = ranks
    for key in ("max_model_len", "max_num_seqs", "kv_offloading_size", "generation_config"):
        if getattr(args, key, None) is not None:
            engine[key] = getattr(args, key)
    for key in ("speculative_config", "override_generation_config"):
        if text := getattr(args, key, None):
            try:
                engine[key] = json.loads(text)
            except json.JSONDecodeError as exc:
                flag = "--" + key.replace("_", "-")
                raise SystemExit(f"{flag} is not JSON ({exc}): {text!r}") from None
    if 0 < per_replica < 1:  # replicas sharing a GPU: each sizes its KV cache to its share
        engine["gpu_memory_utilization"] = round(0.9 * per_replica, 3)
    role = {"num_gpus": per_replica, "num_cpus": 0.5}
    def scaled(replicas: int, autoscaling: str | None, flag: str) -> dict:
        if autoscaling is None:
            return {**role, "num_replicas": replicas}
        try:
            return {**role, "autoscaling_config": json.loads(autoscaling)}
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{flag} is not JSON ({exc}): {autoscaling!r}") from None

    router = {"num_replicas": args.api_server_count}
    if args.served_model_name:
        router["model_name"] = args.served_model_name
    app = {"mode": "disaggregated" if args.prefill else "colocated", "engine": engine,
           "decode": scaled(args.decode, args.decode_autoscaling, "--decode-autoscaling"),
           "router": router}
    if args.prefill:
        app["prefill"] = scaled(args.prefill, args.prefill_autoscaling, "--prefill-autoscaling")
        app["disaggregation"] = {"mode": args.disaggregation}
        if args.max_local_prefill_length is not None:
            app["disaggregation"]["max_local_prefill_length"] = args.max_local_prefill_length
        if args.itl_target_ms is not None:
            app["disaggregation"]["itl_target_ms"] = args.itl_target_ms
    return {"proxy_location": "EveryNode",
            "http_options": {"host": args.host, "port": args.port},
            "grpc_options": {"port": args.grpc_port, "enable_reflection": args.grpc_reflection,
                             "grpc_servicer_functions": [GRPC_SERVICER]},
            "applications": [{"name": "baton", "route_prefix": "/",
                              "import_path": "deploy.app:build_app", "args": app}]}


def open_without_key_warning(config: dict) -> str | None:
    """A warning when the app listens beyond this machine and no API key guards it."""
    host = (config.get("http_options") or {}).get("host", "127.0.0.1")
    keys = [((a.get("args") or {}).get("router") or {}).get("api_key")
            for a in config["applications"]]
    if host in LOOPBACK or os.environ.get("BATON_API_KEY") or all(keys):
        return None
    return (f"WARNING: listening on {host} (beyond this machine) with no API key: anyone who "
            "reaches the port can use the model. Set BATON_API_KEY (or router.api_key), or "
            "listen on 127.0.0.1.")


def cmd_serve(args) -> None:
    import yaml

    is_file = args.target.endswith((".yaml", ".yml")) or os.path.isfile(args.target)
    if is_file:
        config = yaml.safe_load(open(args.target))
    else:
        args.model = args.target
        from engine.model_source import resolve_model
        resolve_model(args.model)  # a clear error now, not in a replica's log later
        config = serve_config_from_flags(args)
    if args.print_config:
        print(yaml.safe_dump(config, sort_keys=False), end="")
        return
    if warning := open_without_key_warning(config):
        print(warning, file=sys.stderr, flush=True)
    run_config(config, args.address, args.timeout, label=args.target)


def run_config(config: dict, address: str | None, timeout: float, label: str) -> None:
    """Serve ``config``'s applications until Ctrl-C, then stop what this command started: on a
    Ray of its own, Serve and Ray; on a cluster it joined (``address``), only its applications."""
    import ray
    from ray import serve

    from deploy.app import build_app

    for app in config["applications"]:
        if app["import_path"] != "deploy.app:build_app":
            raise SystemExit(f"{label}: import_path must be deploy.app:build_app")
    http = dict(config.get("http_options") or {})
    _start_ray(address=address, host=http.get("host") or "127.0.0.1")
    grpc_options = dict(config.get("grpc_options") or {})
    http["port"] = http.get("port") or free_port()
    grpc_options["port"] = grpc_options.get("port") or free_port()
    grpc_options.setdefault("enable_reflection", False)
    serve.start(http_options=http, grpc_options=grpc_options)
    names = [app.get("name", "baton") for app in config["applications"]]
    try:
        for name, app in zip(names, config["applications"]):
            serve.run(build_app(app.get("args")), name=name,
                      route_prefix=app.get("route_prefix", "/"), blocking=False)
        watch_startup(names, timeout=timeout)
        host = http.get("host") or "127.0.0.1"
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(f"serving {label}: http://{shown}:{http['port']}/v1 (OpenAI), gRPC "
              f"{shown}:{grpc_options['port']}; Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        if address is None:
            serve.shutdown()
            ray.shutdown()
        else:
            for name in names:
                serve.delete(name)


def _engine_flags(parser) -> None:
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the weights at load (an FP8 checkpoint needs no flag)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the KV cache's element type (auto: the model's dtype)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _serve_parser(sub)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    {"demo": cmd_demo, "serve": cmd_serve, "generate": cmd_generate}[args.command](args)
    return 0


def _demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="disaggregated serving on local Ray, a few requests")
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    demo.add_argument("--timeout", type=float, default=300,
                      help="seconds the app may take to start, and each request")
    demo.add_argument("--cpu", action="store_true", help="stay on CPU even with a GPU")
    _engine_flags(demo)


def _count(least: int):
    """An argparse type: an integer of at least ``least``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"at least {least}, not {value}")
        return value
    return parse


def _pool_flags(serve_cmd) -> None:
    """The roles' pools: replicas (fixed or autoscaled) and where prompts are prefilled."""
    serve_cmd.add_argument("--prefill", type=_count(0), default=1,
                           help="prefill replicas (0: colocated, decode replicas prefill)")
    serve_cmd.add_argument("--decode", type=_count(1), default=1, help="decode replicas")
    for role in ("prefill", "decode"):
        serve_cmd.add_argument(
            f"--{role}-autoscaling", default=None, metavar="JSON",
            help=f"{role} replicas sized from the load: Ray Serve's autoscaling_config as JSON, "
                 'for example \'{"min_replicas": 1, "max_replicas": 4}\' (Baton\'s policy '
                 f"unless it names one; --{role} is then ignored)")
    serve_cmd.add_argument("--disaggregation", choices=["auto", "always", "never"],
                           default="auto",
                           help="where each request is prefilled: auto (on the decode replica "
                                "when the uncached part of its prompt is short or the prefill "
                                "replicas are saturated), always (by a prefill replica), never")
    serve_cmd.add_argument("--max-local-prefill-length", type=int, default=None,
                           help="auto: the longest uncached part prefilled on the decode "
                                "replica (default 1000 tokens)")
    serve_cmd.add_argument("--itl-target-ms", type=float, default=None,
                           help="auto: hand a prompt over rather than prefill it on a decode "
                                "replica whose step would then exceed this inter-token time")


def _serve_parser(sub) -> None:
    serve_cmd = sub.add_parser(
        "serve", help="serve a model or a Serve config file until Ctrl-C",
        description="Serve a model (a folder, a Hugging Face repo id in the local cache, "
                    "dummy:Qwen3-<size> or tiny) or a Serve config file on a local Ray of its "
                    "own, until Ctrl-C; then stop what it started.")
    serve_cmd.add_argument("target", metavar="MODEL|CONFIG",
                           help="a model, or a Serve config file (.yaml)")
    _pool_flags(serve_cmd)
    serve_cmd.add_argument("--gpus-per-replica", type=float, default=None,
                           help="GPUs of each replica's rank (default: a GPU each, or equal "
                                "shares of the GPUs there are; 0 on a machine without one)")
    serve_cmd.add_argument("--tensor-parallel-size", "--tensor-parallel", type=_count(1), default=1,
                           help="ranks each replica's model is split over, both roles (one "
                                "GPU each; a config sets it per role)")
    serve_cmd.add_argument("--host", default="127.0.0.1",
                           help="HTTP address to listen on (0.0.0.0: every interface; set "
                                "BATON_API_KEY first)")
    serve_cmd.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one)")
    serve_cmd.add_argument("--grpc-port", type=int, default=9000,
                           help="gRPC port (0: a free one)")
    serve_cmd.add_argument("--grpc-reflection", action="store_true",
                           help="serve gRPC server reflection (off unless asked)")
    serve_cmd.add_argument("--served-model-name", default=None,
                           help="the name in /v1/models (default: MODEL)")
    serve_cmd.add_argument("--api-server-count", type=int, default=2,
                           help="ingress replicas, each an HTTP and gRPC server behind HAProxy "
                                "(vLLM's name); two, so that one's death cuts only its own "
                                "streams and new requests go to the other at once")
    serve_cmd.add_argument("--max-model-len", type=int, default=None,
                           help="context length (default: the model's)")
    serve_cmd.add_argument("--max-num-seqs", type=int, default=None,
                           help="sequences in one replica's running batch (default 256)")
    serve_cmd.add_argument("--kv-offloading-size", type=float, default=None,
                           help="GiB of host memory per replica under the prefix cache "
                                "(vLLM's name; default 0: off)")
    serve_cmd.add_argument("--speculative-config", default=None,
                           help="speculative decoding, vLLM's JSON: e.g. '{\"method\": "
                                "\"ngram\", \"num_speculative_tokens\": 4}' or '{\"method\": "
                                "\"draft_model\", \"model\": \"dummy:Qwen3-0.6B\", "
                                "\"num_speculative_tokens\": 4}' (default: off; the decode "
                                "role's)")
    serve_cmd.add_argument("--generation-config", default=None,
                           help="the defaults of the sampling fields a request leaves unset "
                                "(vLLM's name): auto (the model folder's "
                                "generation_config.json, the default), vllm (none: temperature "
                                "1, no top-k or top-p) or a folder holding such a file")
    serve_cmd.add_argument("--override-generation-config", default=None, metavar="JSON",
                           help="laid over the generation config (vLLM's name), e.g. "
                                "'{\"temperature\": 0.7, \"max_new_tokens\": 512}'")
    _engine_flags(serve_cmd)
    serve_cmd.add_argument("--address", default=None,
                           help="join this Ray cluster (auto: the one `ray start` runs here) "
                                "instead of starting a local one; Ctrl-C then removes only "
                                "this command's applications")
    serve_cmd.add_argument("--print-config", action="store_true",
                           help="print the equivalent Serve config (YAML) and exit")
    serve_cmd.add_argument("--timeout", type=float, default=1800,
                           help="seconds the applications may take to start")


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="offline generation")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default="tiny",
                     help="a folder, a Hugging Face repo id in the local cache, "
                          "dummy:Qwen3-<size> or tiny")
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    gen.add_argument("--dtype", default=None,
                     help="float32, bfloat16 or float16 (default: float32 on CPU, the "
                          "checkpoint's on a GPU)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--token-ids", action="store_true", help="prompts are comma-separated ids")
    _engine_flags(gen)


if __name__ == "__main__":
    sys.exit(main())
