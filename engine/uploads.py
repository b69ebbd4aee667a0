"""Host tensors from Python lists, and host → device copies that never wait on the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then waits for the
stream to drain, which would tie the host to the step running before it (the engine prepares
step N+1 while step N runs). :func:`upload` goes through pinned memory with ``non_blocking``;
torch's pinned-memory cache keeps each buffer alive until its copy has run.
"""

from __future__ import annotations

from array import array

import torch

_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f", torch.float64: "d"}


def host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a flat list (through a packed array where it can: ~3x faster than
    ``torch.tensor`` on long lists)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array(code, values), dtype=dtype)


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a flat list or a CPU tensor) on ``device``, without a host sync."""
    host = values if isinstance(values, torch.Tensor) else host_tensor(values, dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
