"""The model's recommended sampling for the fields a request leaves unset (vLLM's
``generation_config``): read, overridden, checked, and applied by the ingress (HTTP and gRPC)
and by the offline ``LLM``."""

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.generation_config import sampling_defaults
from engine.tiny import ensure_tiny_model
from router.ingress.protocol import ChatCompletionRequest, CompletionRequest

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
         "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
         "transformers_version": "4.51.0"}  # Qwen3's generation_config.json
QWEN3_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _folder(tmp_path, config: dict, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_model_folders_file_and_vllm_reads_none(tmp_path):
    folder = _folder(tmp_path, QWEN3)
    assert sampling_defaults(folder) == QWEN3_DEFAULTS
    assert sampling_defaults(folder, "vllm") == {}
    assert sampling_defaults(None) == {}  # a dummy model: no folder
    assert sampling_defaults(tmp_path) == {}  # a folder without the file: nothing to read


def test_a_named_folder_and_the_override(tmp_path):
    other = _folder(tmp_path, {"temperature": 0.3, "min_p": 0.05, "max_new_tokens": 64,
                               "repetition_penalty": 1.1, "top_k": None}, "other")
    want = {"temperature": 0.3, "min_p": 0.05, "max_tokens": 64, "repetition_penalty": 1.1}
    assert sampling_defaults(_folder(tmp_path, QWEN3), str(other)) == want
    assert sampling_defaults(None, "vllm", {"temperature": 0.7, "max_new_tokens": 9}) == \
        {"temperature": 0.7, "max_tokens": 9}
    assert sampling_defaults(_folder(tmp_path, QWEN3, "q"), "auto", {"top_k": 5}) == \
        {**QWEN3_DEFAULTS, "top_k": 5}


def test_bad_settings_are_refused_at_start_naming_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json in"):
        sampling_defaults(None, str(tmp_path))
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(_folder(tmp_path, {"top_p": 1.5}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="is not JSON"):
        sampling_defaults(tmp_path / "broken", "auto")
    with pytest.raises(ValueError, match="unknown do_sample; known: temperature"):
        EngineConfig(override_generation_config={"do_sample": True})
    assert EngineConfig(override_generation_config={"max_new_tokens": 8}) \
        .override_generation_config == {"max_new_tokens": 8}


def test_unset_fields_take_the_defaults_and_set_ones_win():
    """Each field alone (a request setting only the temperature keeps the file's top-k and
    top-p); the default max_tokens caps an asked one, as vLLM's max_new_tokens does."""
    defaults = {**QWEN3_DEFAULTS, "max_tokens": 50}
    plain = CompletionRequest(prompt="hi").sampling_params(16, None, defaults=defaults)
    assert (plain.temperature, plain.top_k, plain.top_p, plain.max_tokens) == (0.6, 20, 0.95, 16)
    own = CompletionRequest(prompt="hi", temperature=0, top_k=-1, max_tokens=80) \
        .sampling_params(16, None, defaults=defaults)
    assert (own.greedy, own.top_k, own.top_p, own.max_tokens) == (True, -1, 0.95, 50)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=1.0,
                                 max_completion_tokens=30).sampling_params(
        100, None, defaults=defaults)
    assert (chat.temperature, chat.top_k, chat.top_p, chat.max_tokens) == (0.6, 20, 1.0, 30)
    none = CompletionRequest(prompt="hi").sampling_params(16, None)
    assert none == SamplingParams(max_tokens=16)


def test_grpc_unset_fields_take_the_defaults():
    from proto import baton_pb2
    from router.ingress.grpc_api import completion_request

    req = baton_pb2.GenerateRequest(prompt="hi", top_k=4, max_tokens=7)
    params = completion_request(req).sampling_params(16, None, defaults=QWEN3_DEFAULTS)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == \
        (0.6, 4, 0.95, 7)


def test_the_ingress_applies_what_the_app_hands_it(tmp_path):
    """build_app hands the decode role's settings to the ingress; its service builds every
    request's parameters over the defaults it read at start."""
    from deploy.app import build_app
    from router.ingress.service import RequestService

    app = build_app({"mode": "colocated", "engine": {
        "model": "tiny", "generation_config": "vllm",
        "override_generation_config": {"temperature": 0.5}}})
    engine = app._bound_deployment.init_args[-2]
    assert (engine["generation_config"], engine["override_generation_config"]) == \
        ("vllm", {"temperature": 0.5})

    async def ids(prompt):
        return [1, 2, 3]
    svc = SimpleNamespace(default_max_tokens=16, prompt_ids=ids,
                          sampling_defaults=sampling_defaults(
                              None, engine["generation_config"],
                              engine["override_generation_config"]))
    _, params, _ = asyncio.run(RequestService.completion_inputs(
        svc, CompletionRequest(prompt=[1, 2, 3])))
    assert (params.temperature, params.top_k) == (0.5, -1)


def test_offline_generate_without_params_uses_the_models_file(tmp_path):
    """A folder whose file asks greedy answers of 5 tokens: generate() without parameters
    gives the tokens of explicit greedy parameters."""
    folder = tmp_path / "tiny"
    shutil.copytree(ensure_tiny_model(), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(
        {**gen, "temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(folder), num_blocks=64, show_progress=False)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    prompts = ["The quick brown fox", "Hello there"]
    got = llm.generate(prompts, use_tqdm=False)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(len(c.token_ids) <= 5 for c in got)


def test_the_ingress_and_the_routers_follow_the_decode_roles_own_engine():
    """A decode role's own engine overrides (its model, context, block size) are what the
    ingress serves (tokenizer, served name, context checks) and what its router hashes."""
    from deploy.app import build_app

    app = build_app({"mode": "colocated", "engine": {"model": "tiny"}, "decode": {"engine": {
        "model": "dummy:Qwen3-0.6B", "max_model_len": 2048, "block_size": 32}}})
    decode, model, served, max_model_len = app._bound_deployment.init_args[:4]
    assert (model, served, max_model_len) == ("dummy:Qwen3-0.6B", "dummy:Qwen3-0.6B", 2048)
    router_kwargs = decode._bound_deployment._deployment_config.request_router_config
    assert router_kwargs.request_router_kwargs["block_size"] == 32
