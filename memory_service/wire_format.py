"""Requests whose bytes do not parse: where in the message the wire format breaks, for the INVALID_ARGUMENT message
(a string field that is not valid UTF-8 is the usual case: protobuf refuses the whole message for it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class UnparsableRequest:
    """What an RPC gets in place of its request when the bytes are not a valid message of the request's type."""

    message_type: str  # the request type's full name
    field: str  # the field path where the bytes break ("request" when no field can be named)
    problem: str


class _MessageClass(Protocol):
    DESCRIPTOR: Descriptor

    def FromString(self, data: bytes) -> Message: ...


def request_parser(message_class: _MessageClass) -> Callable[[bytes], Message | UnparsableRequest]:
    """A gRPC request deserializer that never raises: a message, or an UnparsableRequest saying what broke."""

    def parse(data: bytes) -> Message | UnparsableRequest:
        try:
            return message_class.FromString(data)
        except DecodeError:
            field, problem = _first_break(data, message_class.DESCRIPTOR, "") or ("", "")
            return UnparsableRequest(message_class.DESCRIPTOR.full_name, field or "request",
                                     problem or "malformed protobuf")

    return parse


class _Truncated(Exception):
    pass


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data) or shift > 63:
            raise _Truncated
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, offset


def _first_break(data: bytes, descriptor: Descriptor, path: str) -> tuple[str, str] | None:
    """(field path, problem) of the first field of `descriptor` whose bytes in `data` do not parse; None when this
    reading finds none (protobuf refused the message for a reason it does not look for)."""
    counts: dict[int, int] = {}
    offset = 0
    try:
        while offset < len(data):
            tag, offset = _varint(data, offset)
            number, wire_type = tag >> 3, tag & 7
            field = descriptor.fields_by_number.get(number)
            name = (f"{path}.{field.name}" if path else field.name) if field else path
            if field is not None and field.is_repeated:
                name += f"[{counts.get(number, 0)}]"
                counts[number] = counts.get(number, 0) + 1
            if wire_type == _VARINT:
                _, offset = _varint(data, offset)
            elif wire_type in (_FIXED64, _FIXED32):
                offset += 8 if wire_type == _FIXED64 else 4
            elif wire_type == _LENGTH_DELIMITED:
                length, offset = _varint(data, offset)
                if offset + length > len(data):
                    raise _Truncated
                value = data[offset : offset + length]
                offset += length
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return name, "not valid UTF-8 (a string field must be UTF-8 text)"
                elif (field is not None and field.type == FieldDescriptor.TYPE_MESSAGE
                      and (inner := _first_break(value, field.message_type, name)) is not None):
                    return inner
            else:
                return name or "request", f"malformed protobuf (wire type {wire_type})"
            if offset > len(data):
                raise _Truncated
    except _Truncated:
        return path or "request", "malformed protobuf (truncated)"
    return None
