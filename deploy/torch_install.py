"""Which torch build ``make install`` asks pip for (standard library only: it runs before the
virtual environment has anything).

    python3 deploy/torch_install.py 2.13.0     # prints the pip arguments, one per line

- ``BATON_TORCH_INDEX=<url>``: that index, whatever the machine has.
- An NVIDIA GPU (``nvidia-smi`` answers, or the driver is loaded): the default index, whose Linux
  wheel is the CUDA build.
- Linux or Windows without one: PyTorch's CPU wheel index, when it answers within a few seconds
  (from PyPI the pinned Linux wheel requires the CUDA toolkit, cuDNN, NCCL and NVSHMEM: several
  GB a CPU machine never uses).
- Otherwise (macOS, whose wheels are CPU builds; or no network to that index, as on a machine
  whose pip is configured with local wheels) pip's own configuration.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    if os.path.exists("/proc/driver/nvidia/version"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def reachable(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=timeout) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - any failure means: do not rely on it
        return False


def choose(version: str, env: dict, system: str, gpu, reach) -> tuple[list[str], str]:
    """``(pip arguments, why)``; ``gpu`` and ``reach`` are called only when needed."""
    spec = f"torch=={version}"
    if env.get("BATON_TORCH_INDEX"):
        return [spec, "--index-url", env["BATON_TORCH_INDEX"]], "BATON_TORCH_INDEX"
    if system not in ("Linux", "Windows"):
        return [spec], f"{system}: the default wheels are CPU builds"
    if gpu():
        return [spec], "an NVIDIA GPU: the CUDA build"
    if reach(CPU_INDEX):
        return [spec, "--index-url", CPU_INDEX], "no NVIDIA GPU: PyTorch's CPU wheels"
    return [spec], (f"no NVIDIA GPU, and {CPU_INDEX} does not answer: pip's own configuration "
                    "(set BATON_TORCH_INDEX to choose an index)")


def main() -> None:
    version = sys.argv[1] if len(sys.argv) > 1 else "2.13.0"
    args, why = choose(version, dict(os.environ), platform.system(), has_nvidia_gpu, reachable)
    print(f"torch: {why}", file=sys.stderr)
    print("\n".join(args))


if __name__ == "__main__":
    main()
