"""common.grpc_errors: every servicer method, unary or streaming, ends a failed call with its error's status."""

import asyncio
import inspect

import grpc
import pytest

from specdec.common import errors
from specdec.common.grpc_errors import NO_RETRY, reports_errors, retries_spent


class Aborted(Exception):
    pass


class Context:
    """What reports_errors uses of grpc.aio.ServicerContext: abort, which ends the call by raising."""

    async def abort(self, code, details="", trailing_metadata=()):
        self.status = (code, details, trailing_metadata)
        raise Aborted


class Servicer:
    def __init__(self, error: Exception):
        self.error = error

    @reports_errors
    async def Unary(self, request, context):
        raise self.error

    @reports_errors
    async def Streaming(self, request, context):
        yield "first"
        raise self.error

    @reports_errors
    async def AfterItsRetries(self, request, context):
        with retries_spent():
            raise self.error


def status_of(servicer: Servicer, method: str) -> tuple:
    context = Context()

    async def call():
        handler = getattr(servicer, method)
        if inspect.isasyncgenfunction(handler):
            assert [response async for response in handler(None, context)] == ["first"]
        else:
            await handler(None, context)

    with pytest.raises(Aborted):
        asyncio.run(call())
    return context.status


@pytest.mark.parametrize("method", ["Unary", "Streaming"])
def test_each_error_is_told_as_its_status(method):
    for error_type, status in errors.ERROR_STATUS.items():
        error = errors.InvalidArgument("top_k", "must be >= 0") if error_type is errors.InvalidArgument else error_type("why")
        code, details, trailing = status_of(Servicer(error), method)
        assert code == grpc.StatusCode[status.grpc_code] and details == str(error) and trailing == ()
    code, details, _ = status_of(Servicer(RuntimeError("a library's internals")), method)
    assert code == grpc.StatusCode.INTERNAL and details.startswith("internal error (incident ")
    assert "internals" not in details


def test_streaming_methods_stay_async_generators():
    assert inspect.isasyncgenfunction(Servicer.Streaming) and not inspect.isasyncgenfunction(Servicer.Unary)


def test_an_error_after_the_servers_own_retries_tells_the_client_not_to_retry():
    code, details, trailing = status_of(Servicer(errors.Unavailable("no target")), "AfterItsRetries")
    assert (code, details, trailing) == (grpc.StatusCode.UNAVAILABLE, "no target", NO_RETRY)
