"""Reference attention in plain torch over the paged cache (CPU and GPU; slow but exact): the
math runs in float32 whatever the cache's dtype (an FP8 cache is read back times its scales),
and only the output is rounded to the query's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_context import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> None:
        meta.extras["kv_indices"] = meta.kv_indices.to(meta.slot_mapping.device, torch.int64)
        meta.extras["kv_indptr"] = meta.kv_indptr.tolist()

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        qsl, indptr = meta.query_start_loc, meta.extras["kv_indptr"]
        indices = meta.extras["kv_indices"]
        for i, ctx in enumerate(meta.context_lens):
            start, end = qsl[i], qsl[i + 1]
            n_q = end - start
            kv = kv_cache[indices[indptr[i]:indptr[i + 1]]]  # [pages, 2, H, bs, D]
            k = kv[:, 0].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :ctx]
            v = kv[:, 1].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :ctx]
            k, v = k.float(), v.float()
            if kv_cache.dtype == torch.float8_e4m3fn:
                k, v = k * k_scale, v * v_scale
            qi = q[start:end].transpose(0, 1).float()  # [Hq, n_q, D]
            q_pos = torch.arange(ctx - n_q, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
            out[start:end] = o[0].transpose(0, 1).to(q.dtype)
        return out
