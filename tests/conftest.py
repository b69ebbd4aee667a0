import os
from pathlib import Path

import pytest

# One cache of generated models for the whole run (tiny is built once, then reused).
os.environ.setdefault("BATON_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "baton"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
