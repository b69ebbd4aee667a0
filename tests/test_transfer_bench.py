"""The transfer benchmark's caches: in either memory order (block-major, Baton's, and the
benchmark's own layer-major), the regions a push names hold exactly the pushed blocks."""

import pytest
import torch

from benchmarks.transfer_bench import LayerMajorLayout, make_cache
from kvtransfer import KVLayout
from kvtransfer.backends.base import block_runs

FIELDS = dict(model="m", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
NUM_BLOCKS = 10


def _region_values(cache: torch.Tensor, regions) -> torch.Tensor:
    flat = torch.empty(0, dtype=cache.dtype).set_(cache.untyped_storage())
    size = cache.element_size()
    return torch.cat([flat[off // size:(off + n) // size] for off, n in regions])


@pytest.mark.parametrize("layout", [KVLayout(**FIELDS),
                                    LayerMajorLayout(num_blocks=NUM_BLOCKS, **FIELDS)],
                         ids=["block-major", "layer-major"])
def test_regions_hold_exactly_the_pushed_blocks(layout):
    torch.manual_seed(0)
    cache = make_cache("cpu", NUM_BLOCKS, layout)
    src, dst = [4, 5, 6, 9, 1], [1, 2, 3, 4, 8]
    runs = block_runs(src, dst)
    for side, ids in ((0, src), (1, dst)):
        regions = layout.regions(runs, side)
        assert sum(n for _, n in regions) == len(ids) * layout.block_bytes
        got = _region_values(cache, regions).sort().values
        assert torch.equal(got, cache[:, ids].flatten().sort().values)
    per_run = 1 if type(layout) is KVLayout else layout.num_layers
    assert len(layout.regions(runs, 0)) == per_run * len(runs)


def test_layer_major_offsets():
    layout = LayerMajorLayout(num_blocks=NUM_BLOCKS, **FIELDS)
    per = layout.block_bytes_per_layer
    assert layout.regions([(4, 1, 3)], 0) == [(4 * per, 3 * per), ((10 + 4) * per, 3 * per),
                                               ((20 + 4) * per, 3 * per)]
    assert layout.compat_hash() != KVLayout(**FIELDS).compat_hash()
