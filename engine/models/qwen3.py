"""Qwen3 dense decoder with packed QKV and gate/up projections over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.forward_context import get_forward_context
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding, embedding, norm_then
from engine.parallel import all_gather_last, all_reduce, split, tp
from kernels import qk_norm_rope_store, silu_and_mul
from kernels.activation import silu_and_mul_quant
from kernels.fp8 import fp8_gemv_config, fp8_linear, quantize_per_channel
from kernels.gemv import GLU_EPILOGUE, SILU_FUSE_MAX_K, GemvConfig, gemv

# checkpoint name fragment -> (our packed parameter fragment, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        # This rank's heads (all of them without tensor parallelism): qkv is column-parallel,
        # o row-parallel (a partial sum, all-reduced).
        self.group = tp()
        self.num_heads = split(cfg.num_attention_heads, "attention heads")
        self.num_kv_heads = split(cfg.num_key_value_heads, "KV heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope = rope
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        # Set by the model runner once the cache and backend exist.
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # An FP8 cache holds K / k_scale and V / v_scale (the checkpoint's, else 1.0).
        self.k_scale = self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """From the packed projection (the layer runs ``qkv_proj``, its norm maybe fused in)."""
        return self.output(self.attend(self.queries(positions, qkv)))

    # The three parts, apart for the piecewise CUDA graphs (engine.cuda_graph.MixedGraphs):
    # ``attend`` reads the step's plan and runs eagerly between the captured pieces.
    def queries(self, positions: torch.Tensor, qkv: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q/k norm, RoPE and the K/V store in one kernel on CUDA; the rotated ``[T, H, D]``
        queries (into ``out`` when given)."""
        return qk_norm_rope_store(qkv, positions, self.q_norm.weight,
                                  self.k_norm.weight, self.q_norm.eps, self.rope.cos_sin,
                                  self.kv_cache, get_forward_context().slot_mapping,
                                  self.num_heads, self.num_kv_heads, self.k_scale, self.v_scale,
                                  out=out)

    def attend(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.forward(q, self.kv_cache, get_forward_context(), self.k_scale,
                                    self.v_scale, out=out)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.o_proj(o.reshape(-1, self.q_size)), self.group)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.group = tp()
        inter = split(cfg.intermediate_size, "intermediate size")  # this rank's columns
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)
        self.shard_sizes = (inter, inter)

    def glu_in_projection(self, rows: int) -> bool:
        """Whether the gate/up projection ends in the SiLU-and-multiply for these rows (its
        one-row kernel's epilogue, ``kernels.gemv.GLU_EPILOGUE``): one row, neither its norm
        folded in front (``fuse_norm``) nor the activation into the down projection (both
        small models'), and not the block-scaled FP8 format (a program's gate and up rows sit
        in two rows of scale tiles)."""
        gate_up = self.gate_up_proj
        return (GLU_EPILOGUE and rows == 1 and gate_up.gemv_config is not None
                and not gate_up.fuse_norm and gate_up.fp8_block is None
                and self.down_proj.weight.shape[1] > SILU_FUSE_MAX_K)

    def forward(self, gate_up: torch.Tensor, activated: bool = False) -> torch.Tensor:
        """From the packed gate/up projection (run by the layer, like ``qkv_proj``), or from its
        activation when it computed it (``activated``, :meth:`glu_in_projection`): for one row
        of a small model the down projection's kernel computes the SiLU-and-multiply itself
        (``kernels.gemv.SILU_FUSE_MAX_K``); for more rows, the SiLU kernel writes its rows
        quantized where the FP8 down projection would quantize them."""
        down = self.down_proj
        if activated:
            return all_reduce(down(gate_up), self.group)
        if (down.gemv_config is not None and gate_up.shape[0] == 1
                and down.weight.shape[1] <= SILU_FUSE_MAX_K):  # one row: in the kernel
            return all_reduce(down.forward_silu(gate_up), self.group)
        if down.takes_quantized(gate_up.shape[0]):
            xq, xs = silu_and_mul_quant(gate_up)
            return all_reduce(down.forward_quantized(xq, xs, gate_up.dtype), self.group)
        return all_reduce(down(silu_and_mul(gate_up)), self.group)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rope)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, plan: Callable[[], None] | None = None):
        """``plan``: called once the queries are queued, before the attention reads its plan."""
        q, residual = self.before_attention(positions, x, residual)
        if plan is not None:
            plan()
        return self.after_attention(self.self_attn.attend(q), residual)

    def before_attention(self, positions, x, residual, out=None):
        """Norm, qkv projection, q/k norm, RoPE, the K/V store: ``(queries, residual)``, written
        into ``out = (queries, residual)`` when given (a piecewise graph's static buffers)."""
        attn = self.self_attn
        q_out, residual_out = out if out is not None else (None, None)
        qkv, residual = norm_then(attn.qkv_proj, self.input_layernorm, x, residual,
                                  residual_out)
        return attn.queries(positions, qkv, q_out), residual

    def after_attention(self, o, residual):
        """Output projection, norm, MLP: ``(x, residual)`` for the next layer."""
        mlp = self.mlp
        x = self.self_attn.output(o)
        glu = mlp.glu_in_projection(x.shape[0])
        gate_up, residual = norm_then(mlp.gate_up_proj, self.post_attention_layernorm, x,
                                      residual, glu=glu)
        return mlp(gate_up, activated=glu), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(cfg, self.rope) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                plan: Callable[[], None] | None = None) -> torch.Tensor:
        """``plan``: the step's attention plan, called once layer 0's queries are queued (the
        device runs the embedding and layer 0 up to its attention while the host plans)."""
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, plan if i == 0 else None)
        x, _ = self.norm(x, residual)
        return x


class Qwen3ForCausalLM(nn.Module):
    """``forward(input_ids, positions)`` → final hidden states; ``compute_logits`` → float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.group = tp()
        self.model = Qwen3Model(cfg)
        # Under tensor parallelism each rank holds its rows of the vocabulary (tied: the
        # embedding's) and the logits are gathered.
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, split(cfg.vocab_size, "vocabulary"),
                                    bias=False))
        self.lm_head_gemv: GemvConfig | None = None  # one-row logits through the skinny matmul
        # fp8_lm_head: (e4m3 weight, per-row scales) of this rank's vocabulary rows
        self.lm_head_fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                plan: Callable[[], None] | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, plan)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """float32 logits of the head's rounded output, written into ``out`` when given (a
        graph's static buffer: converted there, no float32 copy in between; at 256 rows of a
        151,936-token vocabulary that copy was 0.1 ms a step)."""
        if self.lm_head_fp8 is not None:
            w, scale = self.lm_head_fp8
            one_row = fp8_gemv_config(*w.shape) if self.lm_head_gemv is not None else None
            logits = fp8_linear(hidden, w, scale, None, one_row)
        elif self.lm_head_gemv is not None and hidden.shape[0] == 1:
            logits = gemv(hidden, self.lm_head_weight, self.lm_head_gemv)
        else:
            logits = torch.nn.functional.linear(hidden, self.lm_head_weight)
        logits = all_gather_last(logits, self.group)
        return logits.float() if out is None else out.copy_(logits)

    def quantize_lm_head(self) -> None:
        """``fp8_lm_head``: logits from an e4m3 copy of the head with one scale per vocabulary
        row (the one-row FP8 kernel for a row, W8A8 for more, as the projections)."""
        self.lm_head_fp8 = quantize_per_channel(self.lm_head_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def projections(self) -> dict[str, list[Linear]]:
        """The decode projections of every layer, by name (one shape per name)."""
        out: dict[str, list[Linear]] = {}
        for layer in self.model.layers:
            for name in ("qkv_proj", "o_proj"):
                out.setdefault(name, []).append(getattr(layer.self_attn, name))
            for name in ("gate_up_proj", "down_proj"):
                out.setdefault(name, []).append(getattr(layer.mlp, name))
        return out

    def normed_projections(self) -> dict[str, list[tuple[RMSNorm, Linear]]]:
        """The projections with an RMSNorm (and the residual add) right in front, by name."""
        layers = self.model.layers
        return {"qkv_proj": [(layer.input_layernorm, layer.self_attn.qkv_proj)
                             for layer in layers],
                "gate_up_proj": [(layer.post_attention_layernorm, layer.mlp.gate_up_proj)
                                 for layer in layers]}

    def attention_layers(self) -> list[Qwen3Attention]:
        return [layer.self_attn for layer in self.model.layers]
