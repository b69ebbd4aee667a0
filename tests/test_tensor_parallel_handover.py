"""The KV hand-over between replicas of different tensor-parallel sizes (CPU: gloo, worker
processes sharing their caches with rank 0), driven through the roles as they ship
(``PrefillServer``, ``DecodeServer``) without Ray, over ``local`` and NIXL over DRAM.

For (prefill ranks, decode ranks) in (1, 2), (2, 1), (2, 2): the greedy tokens are those of one
rank colocated, every rank's cache holds exactly its heads of the blocks the sender computed,
a prefix the decode replica holds is not sent again, and both sides are idle afterwards. A part
of a hand-over that fails (one rank's write) fails the whole hand-over: the decode replica
prefills the request itself, with the same tokens, and no block is left held on either side."""

import asyncio

import pytest
import torch

from contracts import TokenSink
from decode_worker.placement import ALWAYS
from decode_worker.server import DecodeServer
from engine import LLM, EngineConfig, SamplingParams
from kvtransfer import LayoutMismatchError, TransferError
from kvtransfer.backends.local import LocalFabric
from kvtransfer.types import KVLayout, check_compatible, head_slice
from prefill_worker.server import PrefillServer
from tests.models import random_prompts
from tests.roles import PrefillHandle, generate, until_idle

pytestmark = pytest.mark.slow  # worker processes: not the inner loop's tier
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts([9, 40], vocab=512, seed=5)
PAIRS = [(1, 2), (2, 1), (2, 2)]


def _config(ranks: int) -> EngineConfig:
    return EngineConfig(model="tiny", num_blocks=128, max_num_seqs=8, tensor_parallel_size=ranks,
                        show_progress=False)


@pytest.fixture(scope="module")
def offline():
    return [o.token_ids for o in LLM("tiny").generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=["local", "nixl"])
def servers(request):
    """Prefill and decode servers of 1 and 2 ranks on one transport."""
    backend = request.param
    kwargs = {"fabric": LocalFabric()} if backend == "local" else {}
    made = {}
    try:
        for ranks in (1, 2):
            made["prefill", ranks] = PrefillServer(_config(ranks), backend, **kwargs)
            made["decode", ranks] = DecodeServer(_config(ranks), backend, PrefillHandle(), 10.0,
                                                 **kwargs, disaggregation=ALWAYS)
        yield made
    finally:
        for server in made.values():
            server.close()


def _pair(servers, p: int, d: int):
    prefill, decode = servers["prefill", p], servers["decode", d]
    decode.prefill.server = prefill
    return prefill, decode


@pytest.mark.parametrize("p,d", PAIRS)
def test_tokens_and_blocks_of_a_split_hand_over(servers, offline, p, d):
    prefill, decode = _pair(servers, p, d)
    assert [r.layout.tp_size for r in prefill.endpoint.ranks] == [p] * p
    assert len(decode.endpoint.info().rank_infos) == d
    sent, landed = _capture_every_rank(prefill, decode)

    async def main():
        sink = TokenSink()
        for i, prompt in enumerate(PROMPTS):
            rid = f"{p}{d}-{i}"
            tokens, result = await generate(decode, sink, prompt, rid, GREEDY)
            assert tokens == offline[i]
            assert result.transfer is not None  # prefilled by the prefill replica
            # Every rank of the receiver holds its heads of what the sender's ranks computed.
            assert torch.equal(_whole(landed[rid]), _whole(sent[rid]))
            full = decode.endpoint.layout.block_bytes * d  # every rank's heads of a block
            assert result.transfer.bytes == len(sent[rid][0][0]) * full
        # The same prompt again: the decode replica holds its full blocks, they are not sent.
        tokens, result = await generate(decode, sink, PROMPTS[1], f"{p}{d}-again", GREEDY)
        assert tokens == offline[1] and result.transfer.blocks_skipped > 0
        await until_idle(prefill, decode)
        await sink.close()

    asyncio.run(main())


def _capture_every_rank(prefill, decode):
    """Per request, every rank's copy of the blocks pushed (sender) and landed (receiver)."""
    sent, landed = {}, {}
    push = prefill.endpoint.push
    admit = decode.aengine.engine.admit

    def copy_then_push(peer, dest, src_block_ids, on_finish=None):
        skip = dest.num_present_tokens // prefill.endpoint.layout.block_size
        ids = list(src_block_ids[skip:skip + len(dest.block_ids)])
        sent[dest.request_id] = [r.kv_cache[:, ids].clone() for r in prefill.endpoint.ranks]
        return push(peer, dest, src_block_ids, on_finish)

    def copy_then_admit(rid, *args):
        h = decode.handovers.get(rid)
        if h is not None:
            ids = list(h.dest.block_ids)
            landed[rid] = [r.kv_cache[:, ids].clone() for r in decode.endpoint.ranks]
        return admit(rid, *args)

    prefill.endpoint.push = copy_then_push
    decode.aengine.engine.admit = copy_then_admit
    return sent, landed


def _whole(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's heads side by side: the whole model's KV of those blocks."""
    return torch.cat(per_rank, dim=3)


@pytest.mark.parametrize("p,d", [(2, 1), (2, 2)])
def test_a_failed_part_fails_the_whole_hand_over_and_the_request_is_prefilled_here(
        servers, offline, p, d):
    """One sender rank's write is refused by its transport: the prefill replica answers only
    once every part has ended, with the failure; the decode replica ends every rank's lease and
    prefills the request itself."""
    prefill, decode = _pair(servers, p, d)
    rank = prefill.endpoint.ranks[1]
    backend = next(iter(rank.backends.values()))
    start = backend.start_write

    def refuse(*args, **kwargs):
        raise TransferError("rank 1's link broke")

    backend.start_write = refuse
    try:
        async def main():
            sink = TokenSink()
            tokens, result = await generate(decode, sink, PROMPTS[1], f"fail-{p}{d}", GREEDY)
            assert tokens == offline[1] and result.transfer is None  # prefilled here
            await until_idle(prefill, decode)
            await sink.close()

        asyncio.run(main())
    finally:
        backend.start_write = start


def test_the_layout_check_maps_heads_and_refuses_what_differs():
    layout = dict(model="m", dtype="float32", num_layers=2, num_kv_heads=8, head_dim=4,
                  block_size=4)
    two = [KVLayout(**layout, tp_size=2, tp_rank=r) for r in range(2)]
    four = [KVLayout(**layout, tp_size=4, tp_rank=r) for r in range(4)]
    for a in two:
        for b in four:
            check_compatible(a, b)  # any two sizes that divide the heads map
    assert head_slice(two[1], four[2]).__dict__ == {"src": 0, "dst": 0, "count": 2}
    assert head_slice(two[1], four[3]).__dict__ == {"src": 2, "dst": 0, "count": 2}
    assert head_slice(four[1], two[0]).__dict__ == {"src": 0, "dst": 2, "count": 2}
    assert head_slice(two[0], four[3]) is None
    with pytest.raises(LayoutMismatchError, match="KV heads cannot be mapped"):
        check_compatible(two[0], KVLayout(**layout, tp_size=3, tp_rank=0))
    with pytest.raises(LayoutMismatchError, match="head_dim: local 4 != peer 8"):
        check_compatible(two[0], KVLayout(**{**layout, "head_dim": 8}, tp_size=2))
