"""The gRPC schema: committed generated code is up to date and usable."""

import subprocess
import sys
from pathlib import Path

import pytest

from proto import generate

PROTO_DIR = Path(generate.__file__).resolve().parent


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    # protoc runs in its own process: loading it next to an already imported protobuf runtime
    # (as Ray does) can crash the interpreter.
    out = tmp_path_factory.mktemp("proto")
    subprocess.run([sys.executable, "-m", "proto.generate", str(out)], check=True,
                   cwd=PROTO_DIR.parent, capture_output=True, timeout=120)
    return out


@pytest.mark.parametrize("name", generate.GENERATED)
def test_committed_code_matches_proto(regenerated, name):
    tmp_path = regenerated
    fresh = (tmp_path / name).read_bytes()
    committed = (PROTO_DIR / name).read_bytes()
    assert fresh == committed, f"{name} is stale: run `python -m proto.generate`"


def test_generate_request_round_trip():
    from proto import baton_pb2

    req = baton_pb2.GenerateRequest(prompt="hello", prompt_token_ids=[1, 2, 3], max_tokens=8,
                                    stop=["\n"], seed=7, request_id="r1")
    assert not req.HasField("temperature")
    req.temperature = 0.5
    assert req.HasField("temperature")

    back = baton_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.prompt == "hello"
    assert list(back.prompt_token_ids) == [1, 2, 3]
    assert back.max_tokens == 8 and back.seed == 7
    assert back.temperature == pytest.approx(0.5)
    assert back.HasField("temperature") and not back.HasField("top_p")


def test_response_usage_round_trip():
    from proto import baton_pb2

    resp = baton_pb2.GenerateResponse(request_id="r1", token_ids=[4, 5], text="hi",
                                      finish_reason="stop", ttft_s=0.25,
                                      usage=baton_pb2.Usage(prompt_tokens=3, completion_tokens=2))
    back = baton_pb2.GenerateResponse.FromString(resp.SerializeToString())
    assert back == resp
    assert back.usage.completion_tokens == 2


def test_servicer_has_all_methods():
    from proto import baton_pb2_grpc

    for method in ("Generate", "GenerateStream", "Health"):
        assert callable(getattr(baton_pb2_grpc.BatonServicer, method, None)), method
    assert hasattr(baton_pb2_grpc, "BatonStub")
    assert hasattr(baton_pb2_grpc, "add_BatonServicer_to_server")


def test_a_generate_request_reads_into_the_completions_model():
    """gRPC's options land in the same sampling parameters as HTTP's, priority and prompt
    logprobs included; an unset one keeps the default."""
    from proto import baton_pb2
    from router.ingress.grpc_api import completion_request

    req = baton_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, priority=-2,
                                    prompt_logprobs=3, n=2)
    params = completion_request(req).sampling_params(16, None)
    assert (params.priority, params.prompt_logprobs, params.n, params.max_tokens) == (-2, 3, 2, 4)
    plain = completion_request(baton_pb2.GenerateRequest(prompt="hi")).sampling_params(16, None)
    assert (plain.priority, plain.prompt_logprobs, plain.max_tokens) == (0, None, 16)
