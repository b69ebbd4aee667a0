"""Prefill and decode role servers in two Ray actors hand KV over NIXL and gloo; the decode
server calls the prefill actor through its actor handle as it calls the prefill deployment."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.models import random_prompts

pytestmark = pytest.mark.e2e
CONFIG = EngineConfig(model="tiny", num_blocks=128)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class PrefillActor:
    """A prefill server in an async actor, keeping the source KV of each push."""

    def __init__(self, backend):
        from prefill_worker.server import PrefillServer
        from tests.roles import capture_pushed_kv
        self.server = PrefillServer(CONFIG, backend)
        self.pushed = capture_pushed_kv(self.server)

    async def prefill(self, req):
        return await self.server.prefill(req)

    async def pushed_kv(self, rid):
        return self.pushed.pop(rid)

    async def gauges(self):
        return self.server.endpoint.held_blocks, self.server.aengine.engine.pool.num_used_blocks


class DecodeActor:
    """A decode server in an async actor whose prefill deployment is the prefill actor (its
    handle answers ``.prefill.remote(req)`` as a Serve handle does)."""

    def __init__(self, backend, prefill):
        from decode_worker.placement import ALWAYS
        from decode_worker.server import DecodeServer
        from tests.roles import capture_landed_kv
        self.server = DecodeServer(CONFIG, backend, prefill, disaggregation=ALWAYS)
        self.landed = capture_landed_kv(self.server)

    async def generate(self, prompt, params, rid):
        from contracts import TokenSink
        from tests.roles import generate, until_idle
        sink = TokenSink()
        tokens, result = await generate(self.server, sink, prompt, rid, params)
        await until_idle(self.server)
        await sink.close()
        return tokens, result.transfer, self.landed.pop(rid)


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_ray_actors_hand_over_kv(ray_cluster, backend):
    ray = ray_cluster
    print("before the actors:", ray.available_resources().get("CPU"), "CPUs free", flush=True)
    prefill = ray.remote(num_cpus=0.5)(PrefillActor).remote(backend)
    decode = ray.remote(num_cpus=0.5)(DecodeActor).remote(backend, prefill)
    try:
        prompts = random_prompts([9, 32, 45], vocab=512, seed=31)
        expected = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]
        try:
            ray.get(prefill.gauges.remote(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            from ray._private import state
            print("resources free:", ray.available_resources(), "of", ray.cluster_resources())
            for actor in state.actors().values():
                if actor["State"] != "DEAD":
                    print(actor["ActorClassName"], actor["State"], actor.get("Pid"),
                          actor.get("RequiredResources"))
            raise
        for i, (prompt, tokens) in enumerate(zip(prompts, expected)):
            got, stats, landed = ray.get(decode.generate.remote(prompt, GREEDY, f"r{i}"),
                                         timeout=120)
            assert got == tokens and stats.blocks_sent == -(-len(prompt) // 16)
            assert torch.equal(ray.get(prefill.pushed_kv.remote(f"r{i}"), timeout=30), landed)
        assert ray.get(prefill.gauges.remote(), timeout=30) == (0, 0)
    finally:
        ray.kill(prefill)
        ray.kill(decode)
