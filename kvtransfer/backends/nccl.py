"""Point-to-point transport over torch.distributed: NCCL between GPUs, gloo on CPU.

Each receiver runs a TCPStore on an OS-chosen port (its ``connection_info``). A sender joins by
taking a ticket from the store; both sides then build a two-rank process group of their own
(sender rank 0, receiver rank 1), so any number of prefill/decode pairs can coexist in one
process. A push posts a small header (transfer id, destination block ids) in the store under the
pair's next sequence number, then sends the packed blocks. The receiver's thread for that sender
polls for the next header, receives the blocks, scatters them into its cache (only while the
transfer is still expected) and reports the transfer as landed. Receives are posted only when a
header says data is on its way, so an idle link never sits in a blocking call (which would hit
the group's timeout, and could not be interrupted at shutdown).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels import copy_blocks
from kvtransfer.backends.base import TransportBackend, block_ids_tensor, head_view
from kvtransfer.types import EndpointInfo, HeadSlice, TransferError, TransferState, is_warm

log = logging.getLogger(__name__)
TAG = 0
POLL_S = 0.0005


@dataclass
class _Link:
    executor: ThreadPoolExecutor  # the link's one thread: its join, then its sends, in order
    joined: Future | None = None
    group: object = None
    store: object = None  # the pair's prefix of the receiver's store
    next_seq: int = field(default=0)


class NcclBackend(TransportBackend):
    name = "nccl"
    receiver_writes = True

    def __init__(self, endpoint_id, kv_cache, layout, host: str = "127.0.0.1",
                 timeout_s: float = 60.0):
        super().__init__(endpoint_id, kv_cache, layout)
        self.host = host
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._landed: list[str] = []
        self._links: dict[str, _Link] = {}
        self._recv_groups: list = []
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True,
                                          name="kv-nccl-accept")]
        self._threads[0].start()
        atexit.register(self.close)  # threads inside torch.distributed must end before exit

    def _make_group(self, store, rank: int):
        if self.kv_cache.is_cuda:
            return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(store, rank, 2, self.timeout)

    def connection_info(self) -> bytes:
        return f"{self.host}:{self.store.port}".encode()

    # -- sender -----------------------------------------------------------------------------
    def connect(self, peer: EndpointInfo) -> None:
        """Start joining ``peer`` on the link's own thread and return at once: the join is a
        rendezvous that waits for the peer (up to the timeout, for one that is gone), and the
        caller is the engine thread. The link's sends queue behind it; a failed join fails
        them, and the endpoint then forgets the link (the next push joins again)."""
        if peer.endpoint_id in self._links:
            return
        link = _Link(ThreadPoolExecutor(1, "kv-nccl-send"))
        link.joined = link.executor.submit(self._join, link, peer)
        self._links[peer.endpoint_id] = link

    def _join(self, link: _Link, peer: EndpointInfo) -> None:
        host, port = peer.connection.decode().rsplit(":", 1)
        client = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        ticket = client.add("joins", 1) - 1
        client.set(f"join/{ticket}", self.endpoint_id)
        link.store = dist.PrefixStore(f"pair/{self.endpoint_id}/", client)
        link.group = self._make_group(dist.PrefixStore("pg/", link.store), rank=0)

    def start_write(self, peer, transfer_id, src_blocks, dst_blocks, heads=None) -> Future:
        link = self._links[peer.endpoint_id]
        return link.executor.submit(self._send, link, transfer_id, list(src_blocks),
                                    list(dst_blocks), heads)

    def _send(self, link: _Link, transfer_id: str, src: list[int], dst: list[int],
              heads: HeadSlice | None) -> None:
        link.joined.result()  # (done: it ran first on this thread) its error, if it failed
        header = {"transfer_id": transfer_id, "dst": dst}
        if heads is not None:  # the receiver writes them at its first head heads.dst
            header["heads"] = [heads.dst, heads.count]
        link.store.set(f"msg/{link.next_seq}", json.dumps(header).encode())
        link.next_seq += 1
        if src:
            cache = head_view(self.kv_cache, heads, 0)
            data = self._packed(cache, len(src))
            copy_blocks(cache, data, block_ids_tensor(src, self.kv_cache.device),
                        torch.arange(len(src), device=self.kv_cache.device))
            link.group.send([data], 1, TAG).wait(self.timeout)

    @staticmethod
    def _packed(cache: torch.Tensor, n: int) -> torch.Tensor:
        """A packed buffer of ``n`` blocks of ``cache`` (a fresh one per push: sends may overlap
        receives)."""
        return torch.empty((cache.shape[0], n, *cache.shape[2:]), dtype=cache.dtype,
                           device=cache.device)

    def release_write(self, handle: Future) -> None:
        handle.cancel()  # a send still queued (behind a join that has not ended) never runs

    def check_write(self, handle: Future) -> TransferState:
        if not handle.done():
            return TransferState.IN_FLIGHT
        if handle.exception() is not None:
            raise TransferError(str(handle.exception()))
        return TransferState.DONE

    def disconnect(self, peer_id: str) -> None:
        link = self._links.pop(peer_id, None)
        if link is not None:
            link.executor.shutdown(wait=False, cancel_futures=True)

    # -- receiver ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        ticket = 0
        while not self._closed.wait(POLL_S * 20):
            key = f"join/{ticket}"
            if not self.store.check([key]):
                continue
            sender = self.store.get(key).decode()
            ticket += 1
            pair_store = dist.PrefixStore(f"pair/{sender}/", self.store)
            try:
                group = self._make_group(dist.PrefixStore("pg/", pair_store), rank=1)
            except Exception as exc:  # noqa: BLE001
                log.warning("kv nccl: could not pair with %s: %s", sender, exc)
                continue
            self._recv_groups.append(group)
            thread = threading.Thread(target=self._recv_loop, args=(sender, group, pair_store),
                                      daemon=True, name=f"kv-nccl-recv-{sender}")
            self._threads.append(thread)
            thread.start()

    def _recv_loop(self, sender: str, group, pair_store) -> None:
        dev = self.kv_cache.device
        seq = 0
        try:
            while not self._closed.wait(POLL_S):
                key = f"msg/{seq}"
                if not pair_store.check([key]):
                    continue
                header = json.loads(pair_store.get(key))
                pair_store.delete_key(key)
                seq += 1
                tid, dst = header["transfer_id"], header["dst"]
                heads = header.get("heads")
                cache = head_view(self.kv_cache, heads and HeadSlice(0, *heads), 1)
                data = None
                if dst:
                    data = self._packed(cache, len(dst))
                    group.recv([data], 0, TAG).wait(self.timeout)
                with self.landing_guard(tid) as expected:
                    if not expected:
                        if not is_warm(tid):  # a link warming's write is meant to drop
                            log.warning("kv nccl: dropped transfer %s (no longer expected)", tid)
                        continue
                    if data is not None:
                        copy_blocks(data, cache, torch.arange(len(dst), device=dev),
                                    block_ids_tensor(dst, dev))
                        if data.is_cuda:  # landed means readable by any stream
                            torch.cuda.current_stream(dev).synchronize()
                    with self._lock:
                        self._landed.append(tid)
        except Exception as exc:  # noqa: BLE001 - the sender went away
            if not self._closed.is_set():
                log.warning("kv nccl: link from %s closed: %s", sender, exc)

    def poll_notifications(self) -> list[str]:
        with self._lock:
            landed, self._landed = self._landed, []
        return landed

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for peer_id in list(self._links):
            self.disconnect(peer_id)
        self._recv_groups.clear()
