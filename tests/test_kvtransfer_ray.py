"""Prefill and decode engines in two Ray actors hand KV over NIXL and gloo."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.models import random_prompts

pytestmark = pytest.mark.e2e
CONFIG = EngineConfig(model="tiny", num_blocks=128)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class PrefillActor:
    def __init__(self, backend):
        from prefill_worker.core import PrefillCore
        self.core = PrefillCore(CONFIG, backend)

    def info(self):
        return self.core.info()

    def prefill(self, prompt, params, dest, peer):
        from benchmarks.engine_peers import prefill_capturing_kv
        return prefill_capturing_kv(self.core, prompt, params, dest, peer)


class DecodeActor:
    def __init__(self, backend):
        from decode_worker.core import DecodeCore
        self.core = DecodeCore(CONFIG, backend)

    def info(self):
        return self.core.info()

    def begin(self, prompt, params):
        return self.core.begin(prompt, params)

    def complete(self, result, dest):
        from benchmarks.engine_peers import finish
        first = self.core.complete(result)
        landed = self.core.endpoint.kv_cache[:, list(dest.block_ids)].clone()
        out = finish(self.core.engine, first)
        return out.token_ids, landed, self.core.held_blocks, self.core.engine.pool.num_used_blocks


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_ray_actors_hand_over_kv(ray_cluster, backend):
    ray = ray_cluster
    print("before the actors:", ray.available_resources().get("CPU"), "CPUs free", flush=True)
    prefill = ray.remote(num_cpus=0.5)(PrefillActor).remote(backend)
    decode = ray.remote(num_cpus=0.5)(DecodeActor).remote(backend)
    try:
        prompts = random_prompts([9, 32, 45], vocab=512, seed=31)
        expected = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]
        try:
            decode_info = ray.get(decode.info.remote(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            from ray._private import state
            print("resources free:", ray.available_resources(), "of", ray.cluster_resources())
            for actor in state.actors().values():
                if actor["State"] != "DEAD":
                    print(actor["ActorClassName"], actor["State"], actor.get("Pid"),
                          actor.get("RequiredResources"))
            raise
        for prompt, tokens in zip(prompts, expected):
            dest = ray.get(decode.begin.remote(prompt, GREEDY), timeout=30)
            result, src_kv = ray.get(prefill.prefill.remote(prompt, GREEDY, dest, decode_info),
                                     timeout=60)
            got, landed, held, used = ray.get(decode.complete.remote(result, dest), timeout=60)
            assert torch.equal(src_kv, landed)
            assert got == tokens
            assert held == 0 and used == 0
    finally:
        ray.kill(prefill)
        ray.kill(decode)
