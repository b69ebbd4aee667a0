"""Attention backends over the paged KV layout. ``torch`` is the reference (CPU and GPU)."""

from engine.attention.base import AttentionBackend
from engine.attention.selector import get_backend

__all__ = ["AttentionBackend", "get_backend"]
