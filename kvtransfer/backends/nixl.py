"""NIXL transport: UCX one-sided WRITE plus a notification carrying the transfer id.

The whole KV cache is registered once (VRAM on GPUs, DRAM on CPU). ``connection_info`` is the
agent's metadata plus the cache's base address; a sender adds the peer agent once and then writes
each push as one descriptor list (a region per run of consecutive blocks, every layer of them;
for part of a tensor-parallel rank's heads, a region per block, layer and K/V:
``KVLayout.regions``). On CPU the UCX backend runs with shared memory (``UCX_TLS=sm,self`` unless
set) and no peer error handling, the configuration that works without network devices.
On GPUs UCX's memory-type cache is off (``UCX_MEMTYPE_CACHE=n`` unless set; see ``__init__``).
``progress_thread`` is NIXL's own (on by default): it moves transfers on by itself but spins a
core. An owner that polls both sides whenever a transfer is in flight (the serving roles' engine
threads) can do without it.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence

from kvtransfer.backends.base import TransportBackend, block_runs
from kvtransfer.types import EndpointInfo, TransferError, TransferState

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<QqI")  # base address, device id, number of blocks
_NOTHING_TO_WRITE = object()


def _import_nixl():
    """``nixl._api``, imported without losing this process's log handlers. Importing nixl runs
    ``logging.config.dictConfig``, which closes every handler already installed; a closed
    ``MemoryHandler`` drops its target, so everything a Serve replica logs afterwards (its
    replica log is a buffering handler in front of a file) would vanish without an error."""
    import logging.handlers

    buffers = [(h, h.target) for ref in list(logging._handlerList)
               if isinstance(h := ref(), logging.handlers.MemoryHandler)]
    from nixl._api import nixl_agent, nixl_agent_config
    for handler, target in buffers:
        if handler.target is None:
            handler.target = target  # a closed FileHandler reopens on its next record
    return nixl_agent, nixl_agent_config


class NixlBackend(TransportBackend):
    name = "nixl"

    def __init__(self, endpoint_id, kv_cache, layout, ucx_params: dict | None = None,
                 progress_thread: bool = True):
        super().__init__(endpoint_id, kv_cache, layout)
        on_gpu = kv_cache.is_cuda
        if not on_gpu:
            os.environ.setdefault("UCX_TLS", "sm,self")
        else:
            # UCX's memory-type cache misses CUDA mappings a process opens after UCX started (a
            # split cache's rank held through a CUDA IPC handle) and takes them for host memory:
            # registering them then fails ("VRAM memory is detected as host by UCX"). Without
            # the cache UCX asks the driver. Read when UCX loads: the process's first backend.
            os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent = nixl_agent(endpoint_id, nixl_agent_config(enable_prog_thread=progress_thread,
                                                               backends=[]))
        params = dict(ucx_params or ({} if on_gpu else {"ucx_error_handling_mode": "none"}))
        self.agent.create_backend("UCX", params)
        self.mem_type = "VRAM" if on_gpu else "DRAM"
        self.device_id = (kv_cache.device.index or 0) if on_gpu else 0
        # The whole cache, whatever view of it the endpoint holds.
        nbytes = kv_cache.numel() * kv_cache.element_size()
        self._reg = self.agent.register_memory([(kv_cache.data_ptr(), nbytes, self.device_id, "")],
                                               self.mem_type)
        self._peers: dict[str, str] = {}  # endpoint id -> remote agent name

    def connection_info(self) -> bytes:
        head = _HEADER.pack(self.kv_cache.data_ptr(), self.device_id, self.kv_cache.shape[1])
        return head + self.agent.get_agent_metadata()

    def connect(self, peer: EndpointInfo) -> None:
        if peer.endpoint_id not in self._peers:
            name = self.agent.add_remote_agent(peer.connection[_HEADER.size:])
            self._peers[peer.endpoint_id] = name.decode() if isinstance(name, bytes) else name

    def start_write(self, peer: EndpointInfo, transfer_id: str, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int], heads=None):
        if not src_blocks:  # the receiver holds everything: only tell it so
            self.agent.send_notif(self._peers[peer.endpoint_id], transfer_id.encode())
            return _NOTHING_TO_WRITE
        remote_base, remote_dev, _remote_blocks = _HEADER.unpack_from(peer.connection)
        runs = block_runs(src_blocks, dst_blocks)
        local_base = self.kv_cache.data_ptr()
        src = [(local_base + off, n, self.device_id)
               for off, n in self.layout.regions(runs, 0, heads)]
        dst = [(remote_base + off, n, remote_dev)
               for off, n in peer.layout.regions(runs, 1, heads)]
        agent = self.agent
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, self.mem_type),
                                       agent.get_xfer_descs(dst, self.mem_type),
                                       self._peers[peer.endpoint_id], transfer_id.encode())
        if agent.transfer(handle) == "ERR":
            agent.release_xfer_handle(handle)
            raise TransferError(f"nixl: transfer {transfer_id} was refused")
        return handle

    def check_write(self, handle) -> TransferState:
        if handle is _NOTHING_TO_WRITE:
            return TransferState.DONE
        state = self.agent.check_xfer_state(handle)
        if state == "DONE":
            return TransferState.DONE
        if state == "ERR":
            return TransferState.FAILED
        return TransferState.IN_FLIGHT

    def release_write(self, handle) -> None:
        if handle is not _NOTHING_TO_WRITE:
            self.agent.release_xfer_handle(handle)

    def poll_notifications(self) -> list[str]:
        notifs = self.agent.get_new_notifs()
        return [m.decode() for msgs in notifs.values() for m in msgs]

    def disconnect(self, peer_id: str) -> None:
        name = self._peers.pop(peer_id, None)
        if name is not None:
            self.agent.remove_remote_agent(name)

    def close(self) -> None:
        for peer_id in list(self._peers):
            self.disconnect(peer_id)
        self.agent.deregister_memory(self._reg)
