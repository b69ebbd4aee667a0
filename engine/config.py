"""Engine configuration (pydantic) and the Qwen3 model description read from ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.quantization import Fp8Scheme, parse_quantization_config

if TYPE_CHECKING:
    import torch

_DTYPES = {  # name -> torch's attribute (torch is imported only where a dtype is made)
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        return getattr(torch, _DTYPES[name.removeprefix("torch.")])
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Qwen3 ``config.json`` the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str = "bfloat16"
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization: Fp8Scheme | None = None  # the checkpoint's (``quantization_config``)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise ValueError(
                f"{source}: not a Qwen3 dense model (model_type={model_type!r}, "
                f"architectures={archs}); Baton serves Qwen3ForCausalLM only")
        rope = raw.get("rope_parameters") or {}
        if raw.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: RoPE scaling ({raw.get('rope_scaling') or rope}) "
                             "is not supported")
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 1e6))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            eos_token_id=eos,
            bos_token_id=raw.get("bos_token_id"),
            quantization=parse_quantization_config(raw.get("quantization_config"), source),
        )

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))


class SpeculativeConfig(BaseModel):
    """vLLM's ``speculative_config``: how tokens are proposed for the target to verify several
    at a step (:mod:`engine.spec_decode`): ``method: "ngram"`` (prompt lookup) or
    ``"draft_model"`` (a smaller model of the target's vocabulary, :mod:`engine.draft_model`)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = Field(ge=1, le=16)
    # ngram: the longest suffix of the sequence, of prompt_lookup_max down to prompt_lookup_min
    # tokens, found earlier in it; the tokens that followed it are proposed (vLLM's defaults:
    # 5 and 5 when neither is given, else the one given for both).
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)
    # draft_model: a smaller model of the target's vocabulary (what EngineConfig.model takes:
    # a folder, "dummy:Qwen3-0.6B" or "tiny"), in the target's dtype, on rank 0.
    model: str | None = None
    # The draft's weights (vLLM's name): "fp8" quantizes a bf16 draft at load, as
    # EngineConfig.quantization does the target (an FP8 checkpoint is detected with no flag).
    # None: as its checkpoint.
    quantization: Literal["fp8"] | None = None
    # The draft's LM head in e4m3 (EngineConfig.fp8_lm_head, for the draft alone); None: as the
    # target's. Lossless either way (the target verifies every proposal); it only changes which
    # tokens the draft proposes now and then, for a head of half the bytes (the 0.6B draft's
    # head is a quarter of its weights).
    fp8_lm_head: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the "
                             "draft: a folder, 'dummy:Qwen3-0.6B' or 'tiny')")
        if self.method == "ngram" and (self.model or self.quantization
                                       or self.fp8_lm_head is not None):
            raise ValueError("speculative_config: 'model', 'quantization' and 'fp8_lm_head' "
                             "are for method 'draft_model'; 'ngram' proposes from the "
                             "sequence itself")
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max or 5
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min is above prompt_lookup_max")
        return self


class EngineConfig(BaseModel):
    """Everything that shapes one engine instance. Validated when built."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype (bf16) on CUDA
    seed: int = 0
    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int | None = Field(None, ge=2)  # None: sized from the memory budget
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)  # the per-step token budget (chunked prefill)
    # Bounded wait (engine.scheduler): a request not yet scheduled after this many seconds
    # preempts (by recompute) the running request of its own priority with the most output
    # tokens among those that have run this long since admitted, so a short request does not
    # wait for a batch of long ones to end. None: off (wait for a slot, or a worse priority's).
    starvation_timeout_s: float | None = Field(1.0, gt=0)
    enable_prefix_caching: bool = True
    # GiB of host memory under the prefix cache (vLLM's kv_offloading_size; engine.kv_offload):
    # full blocks leaving the device cache are kept there and copied back for a returning
    # prefix instead of being computed again. With tensor parallelism, the total over the
    # ranks (as vLLM's): each rank keeps its slice of the same blocks. 0: off.
    kv_offloading_size: float = Field(0.0, ge=0)
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs
    cuda_graph_max_batch: int = Field(256, ge=1)  # largest captured decode batch
    # Piecewise graphs (attention eager between them) for the other steps of up to this many
    # tokens: prefill chunks and prompts joining a decode batch (vLLM's piecewise CUDA graphs,
    # whose largest size is its max_cudagraph_capture_size). 0: such steps run eagerly. None:
    # 512, or 2048 with FP8 weights, whose eager projections cost the host more than a step
    # of 1-2k tokens takes on the GPU (engine.cuda_graph.graph_max_tokens).
    cuda_graph_max_tokens: int | None = Field(None, ge=0)
    # A lone prompt with nothing before it in the cache (a request's first step at low load) of
    # up to this many tokens replays one CUDA graph of the whole step, attention included, in
    # place of the pieces (vLLM's FULL cudagraph mode, here for that one shape; its attention
    # plan is the same for every prompt padded to a size, so it is made once, at capture).
    # None: 2,048 (engine.cuda_graph.prompt_graph_max_tokens); 0: off. Only beside the
    # piecewise graphs (cuda_graph_max_tokens 0 turns both off); sizes by their rule (16, 32,
    # ..., 2,048), past their largest where this is larger.
    cuda_graph_prompt_max_tokens: int | None = Field(None, ge=0)
    # FlashInfer decode on tensor cores, for the decode steps FlashInfer runs (the long ones of
    # up to 8 rows; Baton's kernel runs the others); None: where it pays (GQA ratio of 4 or
    # more, an FP8 KV cache) or where the CUDA-core kernel has no build for the ratio (14B's 5).
    decode_tensor_cores: bool | None = None
    # FP8 weights: "fp8" quantizes a bf16 checkpoint at load (per-channel scales); an FP8
    # checkpoint (Qwen's or compressed-tensors) is detected from config.json with no flag.
    quantization: Literal["fp8"] | None = None
    # The LM head in FP8 too (per-channel e4m3, quantized at load; the bf16 head stays for the
    # embedding it may share): logits of one row read half the bytes (8B: ~0.2 ms of a ~4 ms
    # step). Off by default: it moves the next-token distribution (KL in docs/benchmarks.md).
    # Needs FP8 matmuls (CUDA, compute capability 8.9+, bf16).
    fp8_lm_head: bool = False
    # The KV cache's element type: "auto" is the compute dtype; "fp8" (= "fp8_e4m3") stores
    # e4m3 with a per-layer scale (the checkpoint's k_scale/v_scale, else 1.0, as vLLM).
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    # Launch step N+1 before waiting for step N's tokens (host work overlaps the device's).
    # A step that verifies speculative proposals does not run ahead (engine.spec_decode).
    async_scheduling: bool = True
    # Speculative decoding (vLLM's speculative_config; engine.spec_decode). None: off.
    speculative_config: SpeculativeConfig | None = None
    # One-row (batch-1 decode) projections in bf16/fp16 on CUDA: the Triton skinny matmul
    # (kernels/gemv.py), which beats cuBLAS there on every measured Qwen3 shape.
    triton_gemv: bool = True
    show_progress: bool = True
    # Ranks the model is split over (engine.parallel): heads, columns and the vocabulary;
    # it must divide the attention and KV heads (Qwen3: 1, 2, 4 or 8).
    tensor_parallel_size: int = Field(1, ge=1)
    # The model's recommended sampling for the fields a request leaves unset (vLLM's
    # generation_config; engine.generation_config): "auto" reads the model folder's
    # generation_config.json (Qwen3's: temperature 0.6, top-k 20, top-p 0.95), "vllm" reads
    # none, a folder reads its file. Applied by the ingress and by LLM.generate without params.
    generation_config: str = "auto"
    # Laid over it (vLLM's override_generation_config), by the file's names, e.g.
    # {"temperature": 0.7, "max_new_tokens": 512}.
    override_generation_config: dict[str, float | int] = Field(default_factory=dict)

    @field_validator("override_generation_config")
    @classmethod
    def _known_overrides(cls, v):
        from engine.generation_config import check_override

        return check_override(v)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, v):
        """A torch dtype is taken too (``dtype=torch.float32``), kept by its name."""
        return str(v).removeprefix("torch.") if type(v).__name__ == "dtype" else v

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.device not in ("auto", "cpu", "cuda") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"device: {self.device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return self

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device: {self.device!r} asked for but no CUDA device is "
                                 "available")
            index = int(self.device[5:]) if ":" in self.device else torch.cuda.current_device()
            return torch.device("cuda", index)
        return torch.device(self.device)
