"""Small random Qwen3 checkpoints written through transformers, shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.tiny import ensure_tiny_model, write_random_qwen3

# name -> (dims, tied). GQA 1:1, 2:1 and 4:1; head_dim both equal to and unlike hidden/heads.
RANDOM_CONFIGS = {
    "gqa1-untied": (dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=24), False),
    "gqa2-hd32-untied": (dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32), False),
    "gqa4-hd16-tied": (dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=16), True),
    # Qwen3's 8 KV heads (every size has them): tensor parallelism up to 8 ranks
    "kv8-untied": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=8), False),
}
VOCAB = 256


def random_model(name: str) -> Path:
    """Folder of a random checkpoint (no tokenizer), built once per cache."""
    dims, tied = RANDOM_CONFIGS[name]
    folder = Path(os.environ["BATON_CACHE"]) / f"test-{name}"
    if not (folder / "config.json").is_file():
        write_random_qwen3(folder, dims, vocab_size=VOCAB, tie_word_embeddings=tied,
                           initializer_range=0.2, seed=1)
    return folder


def model_path(name: str) -> Path:
    return ensure_tiny_model() if name == "tiny" else random_model(name)


def random_prompts(lengths, vocab: int = VOCAB, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"):
    """transformers' own greedy generate, one prompt at a time: (tokens, per-step logits)."""
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    results = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                          do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        results.append((out.sequences[0, len(ids):].tolist(),
                        torch.stack(out.logits)[:, 0].cpu()))
    return hf, results
