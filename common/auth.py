"""Bearer tokens on gRPC: the server side refuses a call without the token before its handler runs, the client
side adds the token to every call of a channel.

The check sits in a server interceptor, so a call without the token is refused before any of its request
messages is read or parsed (a 16 MiB message from a stranger costs nothing), and it is written once for every
method. Health checks are exempt (Kubernetes probes and load balancers carry no credentials, and a health status
says nothing about the model or its users), and so is reflection (it describes the public .proto contract).
"""

import hmac

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

AUTHORIZATION = "authorization"
EXEMPT_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")


def token_matches(authorization: str | None, token: str) -> bool:
    """Whether an 'authorization' value is 'Bearer TOKEN' (compared in constant time)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())


def refusal_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED without reading a message."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as streaming handlers must be here  # pragma: no cover

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_streaming)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks and reflection must carry 'authorization: Bearer TOKEN' in its metadata."""

    def __init__(
        self, token: str, message: str = "authorization: send the metadata 'authorization: Bearer <token>' with a valid token"
    ):
        self.token = token
        self.message = message

    async def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").split("/")[0]
        metadata = dict(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if handler is None or service in EXEMPT_SERVICES or token_matches(metadata.get(AUTHORIZATION), self.token):
            return handler
        return refusal_handler(handler, self.message)


class _AddToken:
    """Adds 'authorization: Bearer TOKEN' to the metadata of each call (the same code for the four call kinds)."""

    def __init__(self, token: str):
        self.pair = (AUTHORIZATION, f"Bearer {token}")

    def details_with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class TokenUnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self.details_with_token(details), request)


class TokenUnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self.details_with_token(details), request)


class TokenStreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self.details_with_token(details), request_iterator)


class TokenStreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self.details_with_token(details), request_iterator)


def token_interceptors(token: str | None) -> list:
    """The client interceptors that send the token on every call of a channel; none without a token."""
    if not token:
        return []
    return [TokenUnaryUnary(token), TokenUnaryStream(token), TokenStreamUnary(token), TokenStreamStream(token)]
