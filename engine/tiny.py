"""The ``tiny`` model: a small random Qwen3 checkpoint with a byte-level BPE tokenizer.

It is generated once through transformers (seeded, so every machine builds the same files) into
``$BATON_CACHE/tiny-v2`` (default ``~/.cache/baton``) and then loaded by the ordinary loader, so
the whole weight-loading path is exercised without downloads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

TINY_VERSION = "tiny-v2"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's markup tokens: ordinary added tokens (kept in decoded text, as in Qwen3's tokenizer).
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>"]
# A chat template of Qwen3's form (Baton's own wording): tools listed in the system turn, the
# assistant's tool calls as <tool_call> JSON, tool results as <tool_response> in a user turn,
# earlier reasoning dropped, and the thinking switch (``enable_thinking=False`` opens and closes
# an empty think block for the model).
CHAT_TEMPLATE = (
    "{%- set sys = messages and messages[0].role == 'system' -%}"
    "{%- if tools or sys -%}"
    "{{- '<|im_start|>system\\n' + (messages[0].content if sys else '') -}}"
    "{%- if tools -%}"
    "{{- ('\\n\\n' if sys else '') + '# Tools\\n\\nFunctions you may call, as JSON signatures "
    "inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with a JSON object of its name and arguments "
    "inside <tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '\\n' if (content or not loop.first) else '' -}}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (resources.files("engine") / "tiny_corpus.txt").read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(MARKUP_TOKENS),
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
    wrapped.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
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
