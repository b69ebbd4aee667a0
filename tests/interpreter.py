"""Kernels run by Triton's interpreter on a CPU host (float16 and FP8: the interpreter misreads
bfloat16), in a subprocess so that ``TRITON_INTERPRET`` takes effect before Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(code: str, timeout: float) -> None:
    """Run ``code`` under the interpreter from the repository root; it must print ``checked``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0 and "checked" in run.stdout, run.stderr[-3000:]
