"""Which torch build `make install` asks for: the CPU wheels on a machine without an NVIDIA GPU
(where PyTorch's index answers), the default (CUDA) build with one, pip's own configuration
otherwise."""

from deploy.torch_install import CPU_INDEX, choose


def _never():
    raise AssertionError("not consulted")


def test_no_gpu_and_the_cpu_index_answers_takes_the_cpu_wheels():
    args, why = choose("2.13.0", {}, "Linux", lambda: False, lambda url: url == CPU_INDEX)
    assert args == ["torch==2.13.0", "--index-url", CPU_INDEX]
    assert "CPU" in why


def test_an_nvidia_gpu_takes_the_default_cuda_build():
    assert choose("2.13.0", {}, "Linux", lambda: True, _never)[0] == ["torch==2.13.0"]


def test_no_gpu_and_no_index_falls_back_to_pips_configuration():
    args, why = choose("2.13.0", {}, "Linux", lambda: False, lambda url: False)
    assert args == ["torch==2.13.0"] and "BATON_TORCH_INDEX" in why


def test_macos_wheels_are_cpu_builds_already():
    assert choose("2.13.0", {}, "Darwin", _never, _never)[0] == ["torch==2.13.0"]


def test_an_explicit_index_wins():
    args, _ = choose("2.13.0", {"BATON_TORCH_INDEX": "https://example/whl"}, "Linux", _never,
                     _never)
    assert args == ["torch==2.13.0", "--index-url", "https://example/whl"]
