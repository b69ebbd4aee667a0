"""The ranks 1..N-1 of a tensor-parallel engine ("the other ranks"; not to be confused with the
prefill and decode roles' Serve deployments): processes that each hold a slice of the model and
its KV cache, and run every step rank 0 (the engine) runs, on the same inputs.

Lifecycle: :class:`RankProcesses` (rank 0) spawns the workers → every rank joins the group
(:func:`engine.parallel.init_tp`) → rank 0 loads its slice and sizes the KV cache, then tells
the workers how many blocks to make (every rank must have the same) → the workers load their
slices and build their runners → on CUDA all ranks warm up (and capture their decode graphs)
together → on request (a transfer endpoint is made for the engine) each worker shares its KV
cache with rank 0 (shared memory on CPU, a CUDA IPC handle on GPUs), so rank 0's transfer layer
moves every rank's slice of a block → per step rank 0 sends the step's host inputs
(``ModelRunner.prepare``: ids, positions, slots, attention metadata, logit rows) to every
worker and all ranks run it; the row-parallel layers all-reduce, the LM head gathers the
vocabulary, and only rank 0 samples, then broadcasts the sampled tokens: with the engine one
step ahead, the next step's inputs read them on every rank's device, as on rank 0's.

The scheduler, the block tables and the sampler live on rank 0 only; a worker never decides
anything. A worker that dies makes rank 0's next send or collective fail (collectives time out
after ``TIMEOUT_S``), and the engine with it: the serving layer then replaces the replica.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
import threading
from dataclasses import replace

log = logging.getLogger(__name__)
TIMEOUT_S = 120.0  # a collective (or a worker's answer) that takes longer fails the engine


def rank_device(config, rank: int):
    """Rank ``rank``'s device: the engine's, offset by the rank on CUDA."""
    device = config.resolved_device()
    if device.type != "cuda":
        return device
    import torch
    return torch.device("cuda", device.index + rank)


def _worker(rank: int, size: int, init_method: str, config: dict, conn) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.parallel import broadcast, destroy_tp, init_tp
    from engine.rank import build_rank

    cfg = EngineConfig(**config)
    device = rank_device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = runner = None
    try:
        group = init_tp(rank, size, init_method, device, TIMEOUT_S)
        cmd, num_blocks = conn.recv()
        assert cmd == "build", cmd
        runner = build_rank(cfg.model_copy(update={"num_blocks": num_blocks}), device, group)
        conn.send(("ready", runner.num_blocks))
        tokens = None  # the previous step's sampled tokens (rank 0 broadcasts them)
        while True:
            cmd, payload = conn.recv()
            if cmd == "step":
                runner.run(payload, tokens)
                if payload.logit_rows:  # rank 0 sampled a token for each of these rows
                    tokens = broadcast(torch.empty(len(payload.logit_rows), dtype=torch.int64,
                                                   device=device), group)
            elif cmd == "copy":  # the host tier's copies, queued ahead of the next step
                copies, wait = payload
                runner.copy_blocks(copies)
                if wait:
                    runner.sync_copies()
                    conn.send(("copied", None))
            elif cmd == "host_tier":
                runner.allocate_host_tier(payload)
                conn.send(("host_tier", None))
            elif cmd == "warm_up":
                runner.warm_up(progress=False)
                conn.send(("warm", None))
            elif cmd == "kv_cache":
                conn.send(("kv_cache", _shared_cache(runner)))
            else:
                break
    except EOFError:
        pass  # rank 0 went away
    except Exception:  # noqa: BLE001 - reported, then the process ends (rank 0 fails too)
        log.exception("tensor-parallel rank %d failed", rank)
        raise
    finally:
        if runner is not None:
            runner.release_graphs()  # before the group ends (see DecodeGraphs.release)
        destroy_tp(group)


def _shared_cache(runner) -> tuple:
    """``(cache, handle)``: this rank's KV cache as rank 0 will see it (moved to shared memory
    once on CPU; sent as a CUDA IPC handle on GPUs) and, on GPUs, how any other process opens
    it: a tensor that came through CUDA IPC cannot be sent on again (PyTorch refuses), so rank 0
    hands a peer replica this rank's own handle instead (``(rebuild, args)`` pickled, as
    ``torch.multiprocessing`` makes it)."""
    if not runner.kv_storage.is_cuda:
        runner.kv_storage.share_memory_()
        return runner.kv_cache, None
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor
    return runner.kv_cache, pickle.dumps(reduce_tensor(runner.kv_cache))


class RankProcesses:
    """Rank 0's side: the worker processes and the pipes to them."""

    def __init__(self, config):
        from engine.parallel import init_tp

        size = config.tensor_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="baton-tp-")
        init_method = "file://" + os.path.join(self._dir.name, "rendezvous")
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        self._lock = threading.Lock()  # the pipes: steps (engine thread) and kv_caches()
        self._kv_caches = None
        payload = config.model_dump()
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, size, init_method, payload, child),
                               daemon=True, name=f"baton-tp-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.group = init_tp(0, size, init_method, rank_device(config, 0), TIMEOUT_S)

    def build(self, num_blocks: int) -> None:
        """Every worker builds its slice with ``num_blocks`` KV blocks; waits until they have."""
        for conn in self.conns:
            conn.send(("build", num_blocks))
        for conn in self.conns:
            self._answer(conn, "ready")

    def warm_up(self) -> None:
        for conn in self.conns:
            conn.send(("warm_up", None))

    def warmed(self) -> None:
        for conn in self.conns:
            self._answer(conn, "warm")

    def step(self, step) -> None:
        """Send a step's host inputs to every worker (its prompt-logprob owners stay here)."""
        step = replace(step, prompt=replace(step.prompt, owners=[]))
        with self._lock:
            for conn in self.conns:
                conn.send(("step", step))

    def allocate_host_tier(self, num_blocks: int) -> None:
        with self._lock:
            for conn in self.conns:
                conn.send(("host_tier", num_blocks))
            for conn in self.conns:
                self._answer(conn, "host_tier")

    def copy_blocks(self, copies, wait: bool) -> None:
        """Queue a batch of the host tier's copies on every worker (each queues them before the
        next step sent after them); with ``wait``, collect their answers with :meth:`copied`."""
        with self._lock:
            for conn in self.conns:
                conn.send(("copy", (copies, wait)))

    def copied(self) -> None:
        """Wait until every worker has finished the copies sent with ``wait``."""
        with self._lock:
            for conn in self.conns:
                self._answer(conn, "copied")

    def kv_caches(self) -> list[tuple]:
        """Ranks 1..N-1's KV caches as views in this process, each with the handle another
        process opens it by (None on CPU) (asked once)."""
        with self._lock:
            if self._kv_caches is None:
                for conn in self.conns:
                    conn.send(("kv_cache", None))
                self._kv_caches = [self._answer(conn, "kv_cache") for conn in self.conns]
        return self._kv_caches

    def _answer(self, conn, want: str):
        if not conn.poll(TIMEOUT_S):
            raise RuntimeError(f"tensor-parallel worker did not answer {want!r} within "
                               f"{TIMEOUT_S:.0f} s")
        got, payload = conn.recv()
        if got != want:
            raise RuntimeError(f"tensor-parallel worker answered {got!r}, not {want!r}")
        return payload

    def dead(self) -> list[int]:
        """The ranks whose process has ended."""
        return [rank for rank, proc in enumerate(self.procs, 1) if not proc.is_alive()]

    def kill(self) -> None:
        """Kill every rank at once (their replica is about to exit; nothing waits for them)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def close(self) -> None:
        from engine.parallel import destroy_tp

        if not self.procs:
            return
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        if not destroy_tp(self.group):  # with the workers, which leave as they stop
            log.warning("tensor-parallel group did not end within 10 s; left to the process")
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns, self._kv_caches = [], [], None
        self._dir.cleanup()
