"""KV-transfer benchmark: GB/s against message size per backend, and the hand-over time.

Two processes, each with a KV cache in Qwen3-8B's layout (36 layers, 8 KV heads, head dim 128,
block 16, bf16: 2.36 MB a block, 302 MB for a 2048-token prompt). The sender pushes N blocks
through a real :class:`kvtransfer.KVEndpoint`; the receiver polls its endpoint and records when
the transfer lands (for ``cuda_ipc``, when the sender's acknowledgement arrives, as in serving).

  hand-over = push called → receiver sees DONE      sender = push called → sender sees DONE
  ceiling   = plain device copy of the same bytes (one GPU) or peer copy cuda:0 → cuda:1

Each push runs with the cache block-major (``NLKHBD``, Baton's) and layer-major (``LNKHBD``, the
order Baton measured against and did not take: :class:`LayerMajorLayout`, which only this
benchmark has).

    python -m benchmarks.transfer_bench --placement same-gpu   # cuda_ipc, nixl
    python -m benchmarks.transfer_bench --placement two-gpu    # nccl, nixl, cuda_ipc
    python -m benchmarks.transfer_bench --placement cpu        # nixl (DRAM), nccl (gloo)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.lib import copy_ceiling
from kvtransfer import KVDestination, KVEndpoint, KVLayout, TransferState

LAYOUT_8B = dict(model="bench-qwen3-8b", num_layers=36, num_kv_heads=8, head_dim=128,
                 block_size=16)
PLACEMENTS = {
    "same-gpu": (("cuda:0", "cuda:0"), ["cuda_ipc", "nixl"]),
    "two-gpu": (("cuda:0", "cuda:1"), ["nccl", "nixl", "cuda_ipc"]),
    "cpu": (("cpu", "cpu"), ["nixl", "nccl"]),
}


@dataclass(frozen=True)
class LayerMajorLayout(KVLayout):
    """A cache stored layer-major, ``[layers, blocks, ...]`` in memory: each layer of a run of
    blocks is a region of its own. ``num_blocks`` is the size of both caches (a layer's offset);
    as a field it is also checked equal on both sides before a push."""

    num_blocks: int = 0

    def regions(self, runs, side: int, heads=None) -> list[tuple[int, int]]:
        assert heads is None, "a layer-major cache moves whole blocks only"
        per_block = self.block_bytes_per_layer
        return [((layer * self.num_blocks + run[side]) * per_block, run[2] * per_block)
                for layer in range(self.num_layers) for run in runs]


def layout_for(order: str, dtype: str, num_blocks: int) -> KVLayout:
    """Qwen3-8B's layout in memory order ``order``: ``NLKHBD`` or ``LNKHBD``."""
    if order == "NLKHBD":
        return KVLayout(dtype=dtype, **LAYOUT_8B)
    if order == "LNKHBD":
        return LayerMajorLayout(dtype=dtype, num_blocks=num_blocks, **LAYOUT_8B)
    raise ValueError(f"memory order: unknown {order!r}; choose NLKHBD or LNKHBD")


def make_cache(device: str, num_blocks: int, layout: KVLayout) -> torch.Tensor:
    """A random cache in ``layout``'s memory order, indexed [layer, block, ...] either way."""
    dtype = getattr(torch, layout.dtype)
    inner = (2, layout.num_kv_heads, layout.block_size, layout.head_dim)
    shape = ((layout.num_layers, num_blocks, *inner) if isinstance(layout, LayerMajorLayout)
             else (num_blocks, layout.num_layers, *inner))
    cache = torch.randn(shape, device=device).to(dtype)
    if dtype.itemsize == 1:  # FP8 blocks move as bytes, as kvtransfer.endpoint_for hands them
        cache = cache.view(torch.uint8)
    return cache if isinstance(layout, LayerMajorLayout) else cache.transpose(0, 1)


def receiver(conn, device: str, backend: str, num_blocks: int, layout: KVLayout) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    ep = KVEndpoint(make_cache(device, num_blocks, layout), layout, backend)
    conn.send(ep.info())
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            ep.close()
            return
        if msg[0] == "checksum":
            conn.send(ep.kv_cache[:, msg[1]].float().sum().item())
            continue
        _, rid, blocks = msg  # "expect"
        dest = KVDestination(rid, ep.endpoint_id, tuple(blocks), 0, time.time() + 120)
        t = ep.expect(dest)
        conn.send(dest)
        while not t.state.is_terminal:
            if conn.poll(0):
                ack = conn.recv()  # control-plane acknowledgement (cuda_ipc)
                ep.mark_landed(ack[1])
            ep.poll()
        conn.send((time.perf_counter(), t.state.name))


def pick_blocks(n: int, num_blocks: int, pattern: str, gen: torch.Generator) -> list[int]:
    if pattern == "contiguous":
        return list(range(1, n + 1))
    return (torch.randperm(num_blocks - 1, generator=gen)[:n] + 1).tolist()


def run_backend(backend: str, devices, sizes, pattern: str, reps: int, num_blocks: int,
                layout: KVLayout) -> list[dict]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, devices[1], backend, num_blocks, layout),
                       daemon=True)
    proc.start()
    try:
        peer = conn.recv()
        if devices[0].startswith("cuda"):
            torch.cuda.set_device(devices[0])
        ep = KVEndpoint(make_cache(devices[0], num_blocks, layout), layout, backend)
        gen = torch.Generator().manual_seed(0)
        rows = []
        for n in sizes:
            handover, sender = [], []
            for rep in range(reps + 2):  # two warm-up pushes
                src = pick_blocks(n, num_blocks, pattern, gen)
                dst = pick_blocks(n, num_blocks, pattern, gen)
                rid = f"{backend}-{n}-{rep}"
                conn.send(("expect", rid, dst))
                dest = conn.recv()
                t0 = time.perf_counter()
                t = ep.push(peer, dest, src)
                if ep.wait(t) is not TransferState.DONE:
                    raise RuntimeError(f"{backend}: push failed: {t.error}")
                t1 = time.perf_counter()
                if not ep.backend.native_notify:
                    conn.send(("ack", t.transfer_id))
                landed, state = conn.recv()
                if state != "DONE":
                    raise RuntimeError(f"{backend}: receiver ended {state}")
                if rep >= 2:
                    handover.append(landed - t0)
                    sender.append(t1 - t0)
            conn.send(("checksum", dst))
            remote = conn.recv()
            local = ep.kv_cache[:, src].float().sum().item()
            nbytes = n * layout.block_bytes
            rows.append(dict(backend=backend, blocks=n, mbytes=nbytes / 1e6, pattern=pattern,
                             descriptors=t.stats.descriptors,
                             handover_ms=statistics.median(handover) * 1e3,
                             sender_ms=statistics.median(sender) * 1e3,
                             gbps=nbytes / statistics.median(handover) / 1e9,
                             checksum_ok=abs(local - remote) <= 1e-3 * max(1.0, abs(local))))
        conn.send(("stop",))
        ep.close()
        return rows
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default="same-gpu")
    p.add_argument("--backends", nargs="*", default=None)
    p.add_argument("--sizes", type=int, nargs="*", default=[1, 4, 16, 64, 128, 256])
    p.add_argument("--patterns", nargs="*", default=["contiguous", "random"])
    p.add_argument("--memory-orders", nargs="*", default=["NLKHBD", "LNKHBD"],
                   choices=["NLKHBD", "LNKHBD"],
                   help="block-major (Baton's) and layer-major cache layouts")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--num-blocks", type=int, default=600)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    devices, backends = PLACEMENTS[args.placement]
    backends = args.backends or backends
    dtype = args.dtype or ("float32" if devices[0] == "cpu" else "bfloat16")
    layout = KVLayout(dtype=dtype, **LAYOUT_8B)  # the ceiling does not depend on the order
    handover_bytes = 128 * layout.block_bytes  # a 2048-token prompt
    ceiling = copy_ceiling(devices, handover_bytes)
    raw_copy_ms = handover_bytes / ceiling * 1e3
    print(f"placement {args.placement} {devices}; block {layout.block_bytes / 1e6:.2f} MB; "
          f"plain copy of 2048 tokens' KV ({handover_bytes / 1e6:.0f} MB): {raw_copy_ms:.3f} ms "
          f"= {ceiling / 1e9:.0f} GB/s (ceiling)")
    rows = []
    for backend in backends:
        for order in args.memory_orders:
            ordered = layout_for(order, dtype, args.num_blocks)
            for pattern in args.patterns:
                try:
                    got = run_backend(backend, devices, args.sizes, pattern, args.reps,
                                      args.num_blocks, ordered)
                except Exception as exc:  # noqa: BLE001 - report, go on with the next one
                    print(f"{backend}/{order}/{pattern}: FAILED: {type(exc).__name__}: {exc}")
                    got = [dict(backend=backend, pattern=pattern, error=str(exc))]
                rows += [dict(r, order=order) for r in got]
    for r in rows:
        if "gbps" in r:
            r["pct_ceiling"] = 100 * r["gbps"] * 1e9 / ceiling
            r["beyond_copy_ms"] = r["handover_ms"] - r["blocks"] * layout.block_bytes / ceiling * 1e3
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(placement=args.placement, devices=devices, ceiling_gbps=ceiling / 1e9,
                           raw_copy_2048_ms=raw_copy_ms, rows=rows), f, indent=1)
    print(f"\n{'backend':9} {'order':6} {'pattern':10} {'blocks':>6} {'MB':>7} {'desc':>5} {'hand-over ms':>12} "
          f"{'sender ms':>9} {'GB/s':>7} {'% ceil':>6} {'>copy ms':>8} ok")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:9} {r['order']:6} {r['pattern']:10} error: {r['error'][:60]}")
            continue
        print(f"{r['backend']:9} {r['order']:6} {r['pattern']:10} {r['blocks']:6d} {r['mbytes']:7.1f} "
              f"{r['descriptors']:5d} {r['handover_ms']:12.3f} {r['sender_ms']:9.3f} "
              f"{r['gbps']:7.1f} {r['pct_ceiling']:6.1f} {r['beyond_copy_ms']:8.3f} "
              f"{'yes' if r['checksum_ok'] else 'NO'}")


if __name__ == "__main__":
    main()
