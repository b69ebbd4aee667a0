"""Which attention backend an engine runs (vLLM's selector): ``auto`` picks FlashInfer where it
builds kernels, the torch reference elsewhere. The backends are imported only when chosen, so
neither imports this module back."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend


def get_backend(name: str, device: torch.device, dtype: torch.dtype,
                decode_tensor_cores: bool | None = None, kv_dtype: torch.dtype | None = None,
                **dims) -> AttentionBackend:
    """``auto``: FlashInfer on CUDA in 16-bit dtypes for the head sizes it builds kernels for
    (64, 128, 256) when it is installed, else torch."""
    if name == "auto":
        name = ("flashinfer" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
                and dims.get("head_dim") in (64, 128, 256) and _has_flashinfer() else "torch")
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(**dims)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend: 'flashinfer' needs a CUDA device")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend: 'flashinfer' needs bfloat16 or float16, not "
                             f"{dtype}")
        try:
            from engine.attention.flashinfer_backend import FlashInferBackend
        except ImportError as exc:
            raise ValueError(f"attention_backend: 'flashinfer' is not available ({exc})") from exc
        return FlashInferBackend(**dims, device=device, dtype=dtype,
                                 decode_tensor_cores=decode_tensor_cores, kv_dtype=kv_dtype)
    raise ValueError(f"attention_backend: unknown backend {name!r}")


def _has_flashinfer() -> bool:
    try:
        import engine.attention.flashinfer_backend  # noqa: F401
    except ImportError:
        return False
    return True
