"""Registers Baton's gRPC service on a server, as the generated ``add_BatonServicer_to_server``
does, but with request parsers that never fail: a message that does not parse (invalid UTF-8 in
a string field, bytes that are no ``GenerateRequest``) reaches the method as an
:class:`Unparsed`, which answers ``INVALID_ARGUMENT`` with the parser's reason. With the
generated parsers the call fails inside gRPC with ``UNKNOWN`` and a protobuf ``DecodeError``
that the application never sees.

Name it in a serving config: ``grpc_servicer_functions: [proto.servicer.add_to_server]``. The
size of a message is bounded before parsing by the gRPC server (``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``,
4 MiB in Baton's Ray environment: ``deploy/ray_env.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from proto import baton_pb2 as pb

SERVICE = "baton.v1.Baton"


@dataclass(frozen=True)
class Unparsed:
    """A request message that did not parse, and why."""

    reason: str


def lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Unparsed(f"request: {str(exc) or 'not a ' + message_type.__name__}")
    return parse


def add_to_server(servicer, server) -> None:
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=lenient(pb.HealthRequest),
            response_serializer=pb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
