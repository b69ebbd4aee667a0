"""The ``baton`` command line.

``baton demo``             1 prefill + 1 decode on local Ray; a few requests over HTTP and gRPC
``baton serve CONFIG``     run a Serve config file (as ``serve deploy`` would) on local Ray
``baton generate PROMPT``  offline generation with the engine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from deploy.ray_env import free_port

DEMO_PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small engine",
    "Question: what is two plus two? Answer:",
]
GRPC_SERVICER = "proto.baton_pb2_grpc.add_BatonServicer_to_server"


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
def _start_ray(num_cpus: int | None = None) -> None:
    import ray

    from deploy import ray_env

    ray_env.apply()  # HAProxy ingress and Serve's throughput profile for this local cluster
    # With num_cpus: a new local instance of that size (the demo), even where another Ray runs
    # here; without: join the Ray that `ray start` brought up on this machine, if there is one.
    ray.init(address="local" if num_cpus else None, num_cpus=num_cpus,
             include_dashboard=False, log_to_driver=False, logging_level="ERROR")


def _demo_config(gpu: bool) -> dict:
    if gpu:  # two replicas on one GPU, CUDA IPC between them
        return {"mode": "disaggregated",
                "engine": {"model": "dummy:Qwen3-0.6B", "gpu_memory_utilization": 0.35,
                           "max_num_seqs": 16},
                "prefill": {"num_gpus": 0.5, "num_cpus": 0.5},
                "decode": {"num_gpus": 0.5, "num_cpus": 0.5},
                "transfer": {"backend": "cuda_ipc"}}
    return {"mode": "disaggregated", "engine": {"model": "tiny", "num_blocks": 512,
                                                "max_num_seqs": 16}}


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
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    t0 = time.perf_counter()
    serve.run(build_app(config), name="baton", route_prefix="/", blocking=False)
    watch_startup(["baton"], timeout=args.timeout)
    wait_ready(f"http://127.0.0.1:{http}", timeout=args.timeout)
    print(f"ready in {time.perf_counter() - t0:.1f}s: http://127.0.0.1:{http}, "
          f"gRPC 127.0.0.1:{grpc_port}\n")
    try:
        for prompt in prompts:
            _demo_http(f"http://127.0.0.1:{http}", prompt, args.max_tokens, args.timeout,
                       requests)
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


def _demo_http(url: str, prompt, max_tokens: int, timeout: float, requests) -> None:
    t0 = time.perf_counter()
    resp = requests.post(f"{url}/v1/completions", stream=True, timeout=timeout,
                         json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "stream": True, "ignore_eos": True})
    resp.raise_for_status()
    print(f"HTTP > {prompt!r}\n  ", end="", flush=True)
    ttft, usage = None, None
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"]["message"])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            if choice["token_ids"] and ttft is None:
                ttft = time.perf_counter() - t0
            shown = choice["text"] if isinstance(prompt, str) else \
                "".join(f"[{t}]" for t in choice["token_ids"])
            print(shown, end="", flush=True)
    moved = usage["kv_transfer"] or {}
    print(f"\n  TTFT {ttft * 1e3:.1f} ms, {usage['completion_tokens']} tokens in "
          f"{time.perf_counter() - t0:.2f}s; KV moved: {moved.get('bytes', 0) / 1e6:.2f} MB in "
          f"{moved.get('blocks_sent', 0)} blocks ({moved.get('blocks_skipped', 0)} skipped), "
          f"{moved.get('seconds', 0) * 1e3:.2f} ms over {moved.get('backend', '-')}\n")


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
            shown = msg.text if isinstance(prompt, str) else "".join(f"[{t}]" for t in msg.token_ids)
            print(shown, end="", flush=True)
            last = msg
        print(f"\n  TTFT {last.ttft_s * 1e3:.1f} ms, {last.usage.completion_tokens} tokens, "
              f"finish: {last.finish_reason}")


def cmd_serve(args) -> None:
    import yaml
    from ray import serve

    from deploy.app import build_app

    config = yaml.safe_load(open(args.config))
    _start_ray()
    serve.start(http_options=config.get("http_options"), grpc_options=config.get("grpc_options"))
    names = []
    for app in config["applications"]:
        if app["import_path"] != "deploy.app:build_app":
            raise SystemExit(f"{args.config}: import_path must be deploy.app:build_app")
        names.append(app.get("name", "baton"))
        serve.run(build_app(app.get("args")), name=names[-1],
                  route_prefix=app.get("route_prefix", "/"), blocking=False)
    watch_startup(names, timeout=args.timeout)
    port = (config.get("http_options") or {}).get("port", 8000)
    print(f"serving {args.config} on port {port}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


def _engine_flags(parser) -> None:
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the weights at load (an FP8 checkpoint needs no flag)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the KV cache's element type (auto: the model's dtype)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="disaggregated serving on local Ray, a few requests")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--timeout", type=float, default=300)
    demo.add_argument("--cpu", action="store_true", help="stay on CPU even with a GPU")
    _engine_flags(demo)
    serve_cmd = sub.add_parser("serve", help="run a Serve config file on local Ray")
    serve_cmd.add_argument("config")
    serve_cmd.add_argument("--timeout", type=float, default=1800,
                           help="seconds the applications may take to start")
    gen = sub.add_parser("generate", help="offline generation")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--model", default="tiny")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default=None)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--token-ids", action="store_true", help="prompts are comma-separated ids")
    _engine_flags(gen)
    args = parser.parse_args(argv)
    {"demo": cmd_demo, "serve": cmd_serve, "generate": cmd_generate}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
