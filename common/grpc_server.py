"""What every specdec gRPC server has: message size limits and keepalive (common.grpc_options), TLS, the bearer
token, health and reflection."""

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.common.auth import BearerTokenInterceptor
from specdec.common.config import ServerOptions
from specdec.common.grpc_options import SERVER_OPTIONS
from specdec.common.services import add_service
from specdec.common.tls import server_credentials


async def create_server(
    service: ServiceDescriptor, servicer, options: ServerOptions, channel_options: tuple = (), token: str | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A server with the servicer, health (NOT_SERVING until the caller says otherwise) and reflection;
    channel_options: gRPC options beyond SERVER_OPTIONS; token: every call but health checks must carry it."""
    interceptors = [BearerTokenInterceptor(token)] if token else []
    server = grpc.aio.server(
        options=[*SERVER_OPTIONS, *channel_options],
        interceptors=interceptors,
        maximum_concurrent_rpcs=options.max_concurrent_rpcs,
    )
    add_service(server, servicer, service)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    # grpc's health servicer starts with the overall status SERVING; ours is SERVING only once a model is loaded.
    await set_serving(health_servicer, [service.full_name], False)
    address = f"{options.host}:{options.port}"
    if options.tls.enabled:
        bound = server.add_secure_port(address, server_credentials(options.tls))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    if options.unix_socket:
        local = f"unix:{options.unix_socket}"
        credentials = server_credentials(options.tls) if options.tls.enabled else None
        if not (server.add_secure_port(local, credentials) if credentials else server.add_insecure_port(local)):
            raise OSError(f"could not bind {local}")
    return server, health_servicer, bound


async def start_serving(
    service: ServiceDescriptor, servicer, options: ServerOptions, channel_options: tuple = (), token: str | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A started server that reports SERVING at once: its engine is ready (tests, benchmarks, the coordinator)."""
    server, health_servicer, bound = await create_server(service, servicer, options, channel_options, token)
    await server.start()
    await set_serving(health_servicer, [service.full_name], True)
    return server, health_servicer, bound


async def set_serving(health_servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)
