"""The ``tiny`` model: a small random Qwen3 checkpoint with a byte-level BPE tokenizer.

It is generated once through transformers (seeded, so every machine builds the same files) into
``$BATON_CACHE/tiny-v1`` (default ``~/.cache/baton``) and then loaded by the ordinary loader, so
the whole weight-loading path is exercised without downloads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

TINY_VERSION = "tiny-v1"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))


def ensure_tiny_model() -> Path:
    """Return the tiny model's folder, generating it first if needed (safe across processes)."""
    target = cache_dir() / TINY_VERSION
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-", dir=target.parent))
    try:
        write_random_qwen3(tmp, TINY_DIMS, tokenizer=train_tokenizer(), seed=0)
        try:
            os.rename(tmp, target)  # atomic; loses harmlessly to a concurrent builder
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the built-in corpus, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (resources.files("engine") / "tiny_corpus.txt").read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def write_random_qwen3(folder: Path, dims: dict, tokenizer=None, seed: int = 0,
                       vocab_size: int | None = None, tie_word_embeddings: bool = True,
                       initializer_range: float = 0.1) -> Path:
    """Write a seeded random ``Qwen3ForCausalLM`` checkpoint (and tokenizer) with transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if tokenizer is not None:
        vocab_size = vocab_size or len(tokenizer)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    else:
        eos, bos = (vocab_size or 256) - 1, None
    config = Qwen3Config(vocab_size=vocab_size, max_position_embeddings=2048, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
                         initializer_range=initializer_range, eos_token_id=eos,
                         bos_token_id=bos, pad_token_id=bos, **dims)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return Path(folder)
