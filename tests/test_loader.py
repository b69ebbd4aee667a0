"""Weight loading: sharded checkpoints, clear errors for wrong folders and tensors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model_source import dummy_names
from tests.models import model_path, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def checkpoint(tmp_path):
    src = model_path("gqa2-hd32-untied")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index_loads_the_same(checkpoint):
    prompts = random_prompts([9, 20])
    expected = [o.token_ids for o in LLM(str(checkpoint)).generate(prompts, GREEDY)]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    (checkpoint / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(checkpoint / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [o.token_ids for o in LLM(str(checkpoint)).generate(prompts, GREEDY)] == expected


def test_bfloat16_cast_on_load(checkpoint):
    llm = LLM(str(checkpoint), dtype="bfloat16")
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    spec = llm.engine.kv_cache_spec()
    assert spec.kv_cache.dtype == torch.bfloat16 and spec.layout.dtype == "bfloat16"
    assert len(llm.generate(random_prompts([5]), GREEDY)[0].token_ids) == 8


def test_missing_and_unexpected_tensors_are_listed(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        LLM(str(checkpoint))
    msg = str(err.value)
    assert "model.layers.1.self_attn.qkv_proj.weight" in msg
    assert "model.layers.9.extra.weight" in msg


def test_wrong_shape_is_named(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        LLM(str(checkpoint))


def test_not_a_qwen3_folder(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a Qwen3 dense model"):
        LLM(str(checkpoint))


def test_the_six_dummy_configs_are_shipped():
    assert dummy_names() == ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-14B", "Qwen3-32B",
                             "Qwen3-4B", "Qwen3-8B"]


def test_tiny_has_a_tokenizer_and_chat_template():
    llm = LLM("tiny")
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert llm.generate("Hello world", GREEDY)[0].text is not None


def test_a_repo_id_resolves_from_the_local_hugging_face_cache(checkpoint, tmp_path, monkeypatch):
    from engine.model_source import resolve_model

    hub = tmp_path / "hub"
    repo = hub / "models--acme--qwen3-small"
    shutil.copytree(checkpoint, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    source = resolve_model("acme/qwen3-small")
    assert source.path == repo / "snapshots" / "abc123" and source.model_id == "acme/qwen3-small"
    prompts = random_prompts([9])
    assert (LLM("acme/qwen3-small").generate(prompts, GREEDY)[0].token_ids
            == LLM(str(checkpoint)).generate(prompts, GREEDY)[0].token_ids)
    with pytest.raises(ValueError, match="not in the Hugging Face cache .*models--acme--other"):
        resolve_model("acme/other")
