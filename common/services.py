"""Registers a servicer on a gRPC server with deserializers that never fail.

gRPC's generated registration parses requests with `FromString`; bytes that are not the expected message end the
call with an opaque INTERNAL error before the servicer sees them. Here a malformed message becomes a
`MalformedMessage` that the servicer turns into INVALID_ARGUMENT naming the field (invalid UTF-8 in a string
field is the common case) -- and the worker's session, if any, is freed as for any other error.
"""

from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError

from specdec.common.errors import InvalidArgument

HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass
class MalformedMessage:
    """Stands in for a request message whose bytes did not parse."""

    field: str
    problem: str

    def error(self) -> InvalidArgument:
        return InvalidArgument(self.field, self.problem)


def check_parsed(request) -> None:
    if isinstance(request, MalformedMessage):
        raise request.error()


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def invalid_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first string field (recursing into messages) whose bytes are not UTF-8, if the wire
    format is otherwise readable."""
    pos, seen = 0, {}
    try:
        while pos < len(data):
            key, pos = read_varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = read_varint(data, pos)
                continue
            if wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                continue
            if wire_type != 2:
                return None
            length, pos = read_varint(data, pos)
            chunk, pos = data[pos : pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            name = f"{prefix}{field.name}" + (f"[{index}]" if field.is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
                found = invalid_utf8_field(field.message_type, chunk, name + ".")
                if found:
                    return found
    except ValueError:
        return None
    return None


def safe_deserializer(message_class):
    descriptor = message_class.DESCRIPTOR

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            pass
        try:
            field = invalid_utf8_field(descriptor, data)
        except Exception:  # noqa: BLE001 - the diagnosis is best effort; a deserializer must never raise
            field = None
        if field:
            return MalformedMessage(field, "is not valid UTF-8")
        return MalformedMessage("request", f"is not a valid {descriptor.full_name} message")

    return deserialize


def add_service(server: grpc.aio.Server, servicer, service: ServiceDescriptor) -> None:
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        factory = HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=safe_deserializer(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
