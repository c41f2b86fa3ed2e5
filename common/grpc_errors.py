"""Errors as gRPC statuses: every servicer method is wrapped by reports_errors (or hands its stream to one that is,
as Draft and Verify do to session_stream), which ends a failed call with the status common.errors.ERROR_STATUS
gives its error, never a crash of the server."""

import contextlib
import functools
import inspect

import grpc

from specdec.common.errors import classified

# Clients with a retry policy retry UNAVAILABLE (the Python client's does, on the next coordinator). A server that
# already spent its own retries on a request sends this with its final UNAVAILABLE: gRPC does not retry a call
# whose server pushes back by a negative delay.
NO_RETRY = (("grpc-retry-pushback-ms", "-1"),)


class RetriesSpent(Exception):
    """An error raised after the server spent its own retries on the request (the coordinator, on its workers):
    told as the error it wraps, with NO_RETRY."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


@contextlib.contextmanager
def retries_spent():
    """Errors raised inside are told with NO_RETRY (see RetriesSpent)."""
    try:
        yield
    except Exception as error:
        raise RetriesSpent(error) from error


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Ends the call with the status that fits the error (common.errors.classified): an unexpected one is INTERNAL
    with an incident id, its detail logged."""
    trailing_metadata = ()
    if isinstance(error, RetriesSpent):
        error, trailing_metadata = error.error, NO_RETRY
    status, message = classified(error)
    await context.abort(grpc.StatusCode[status.grpc_code], message, trailing_metadata)


def reports_errors(method):
    """Wraps a servicer method (request, context): a coroutine, or an async generator for a streaming response
    (it stays one: the handler still writes by yielding), so that every failure becomes the call's status."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                async with contextlib.aclosing(method(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
                await abort_with(context, error)

        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)

    return unary
