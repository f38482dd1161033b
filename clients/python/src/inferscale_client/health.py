"""grpc.health.v1's Check without its generated package (the client depends on grpcio and protobuf only): the two
messages built from their descriptor with protobuf's own factory."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = "SERVING"
_STATUSES = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _messages() -> tuple[type[Message], type[Message]]:
    proto = descriptor_pb2.FileDescriptorProto(name="inferscale_client/health.proto", package="grpc.health.v1")
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    response.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                       label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")))


_REQUEST, _RESPONSE = _messages()


def health_request(service: str) -> bytes:
    return _REQUEST(service=service).SerializeToString()


def health_status(data: bytes) -> str:
    status: int = _RESPONSE.FromString(data).status
    return _STATUSES[status] if 0 <= status < len(_STATUSES) else str(status)
