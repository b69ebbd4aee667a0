"""Model runner: owns the model, the paged KV cache and the attention backend.

One call of :meth:`ModelRunner.execute` is prepare inputs → forward context → forward → logits
of the sequences due a token.
"""

from __future__ import annotations

import logging

import torch

from engine.attention import get_backend
from engine.block_pool import NULL_BLOCK
from engine.config import EngineConfig
from engine.forward_context import AttentionMetadata, set_forward_context
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_GB = 0.25


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        cfg = model.config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = get_backend(config.attention_backend, device,
                                   num_heads=cfg.num_attention_heads,
                                   num_kv_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.head_dim, scale=cfg.head_dim ** -0.5)
        self.num_blocks = self._num_blocks()
        # Memory is block-major, [blocks, layers, K/V, kv heads, block size, head dim], so one
        # block of every layer is one contiguous region (one descriptor per transfer run); the
        # engine and the transfer layer see it as [layers, blocks, ...] (``kv_cache``), where each
        # layer's slice is FlashInfer's HND paged layout with a page stride of all layers.
        self.kv_storage = torch.zeros(
            self.num_blocks, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, self.block_size,
            cfg.head_dim, dtype=dtype, device=device)
        self.kv_cache = self.kv_storage.transpose(0, 1)
        for i, attn in enumerate(model.attention_layers()):
            attn.kv_cache = self.kv_cache[i]
            attn.backend = self.backend

    # -- sizing -----------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        cfg = self.model.config
        return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * self.block_size
                * cfg.head_dim * self.dtype.itemsize)

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_blocks is not None:
            return c.num_blocks
        if c.kv_cache_memory_gb is not None:
            budget = c.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_GB * 2**30
        # Never more than every sequence at full length needs (plus the null block).
        cap = c.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        num = min(int(budget // self.block_bytes), cap)
        if num < 2:
            raise ValueError(f"kv cache: the memory budget ({budget / 2**30:.2f} GiB) holds no "
                             f"block of {self.block_bytes} bytes")
        return num

    def _cuda_kv_budget(self) -> float:
        free, total = torch.cuda.mem_get_info(self.device)
        cfg = self.model.config
        tokens = self.config.max_num_batched_tokens
        # Activations of one step: the widest intermediates, plus float32 logits of every sequence.
        act = tokens * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * self.dtype.itemsize * 2
        act += self.config.max_num_seqs * cfg.vocab_size * 4 * 3
        return total * self.config.gpu_memory_utilization - (total - free) - act

    # -- one step ---------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata, list[int]]:
        bs = self.block_size
        ids, positions, slots, qsl, ctx, logit_rows = [], [], [], [0], [], []
        max_blocks = max(len(s.block_ids) for s in batch.seqs)
        tables = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_ids
            slots += [-1 if p < seq.num_present_tokens else table[p // bs] * bs + p % bs
                      for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            ctx.append(end)
            tables.append(table + [NULL_BLOCK] * (max_blocks - len(table)))
            if end == seq.num_tokens:
                logit_rows.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc=qsl, context_lens=ctx, block_size=bs,
            is_decode_only=all(n == 1 for n in batch.num_new_tokens))
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta, logit_rows)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Run the batch; return float32 logits of the sequences due a token (or None)."""
        input_ids, positions, meta, logit_rows = self.prepare(batch)
        self.backend.plan(meta)
        with set_forward_context(meta):
            hidden = self.model(input_ids, positions)
        if not logit_rows:
            return None
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows])
