"""GenerationService over gRPC: a thin servicer over GenerationEngine, and the coordinator's start-up checks."""

import asyncio
import logging
import socket

import grpc

from common.models import load_tokenizer
from common.telemetry import context_from
from common.server import abort_with, create_server, run_until_signalled, set_serving
from coordinator.engine import CoordinatorConfig, GenerationEngine
from coordinator.requests import params_of, response_of, stream_message_of
from coordinator.worker_clients import GrpcWorkers, wait_until_serving
from coordinator.workers import WorkerInfo, Workers
from specdec.v1 import generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
log = logging.getLogger("specdec.coordinator")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, engine: GenerationEngine):
        self.engine = engine

    async def Generate(self, request, context):
        try:
            params = params_of(request, self.engine.tokenizer, self.engine.config)
            result = await self.engine.generate_all(params, client_trace_context(context))
            return response_of(result, request.include_rounds)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)

    async def GenerateStream(self, request, context):
        try:
            params = params_of(request, self.engine.tokenizer, self.engine.config)
            async for event in self.engine.generate(params, client_trace_context(context)):
                yield stream_message_of(event, request.include_rounds)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)


def client_trace_context(context: grpc.aio.ServicerContext):
    """The caller's trace context from the call's metadata (traceparent), so the request's trace continues it."""
    return context_from((key, value) for key, value in context.invocation_metadata() or ())


class IncompatibleWorkers(Exception):
    """The draft and target cannot work together; the coordinator refuses to start."""


def check_pair(target: WorkerInfo, draft: WorkerInfo | None, tokenizer_fingerprint: str) -> None:
    if tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleWorkers(
            f"the coordinator's tokenizer ({tokenizer_fingerprint}) differs from the target worker's "
            f"({target.model_name}, {target.tokenizer_fingerprint}); pass --tokenizer with the target's model"
        )
    if draft is not None and draft.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleWorkers(
            f"draft model {draft.model_name!r} and target model {target.model_name!r} use different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint} and {target.tokenizer_fingerprint}); "
            "speculative decoding needs both to share one vocabulary"
        )


def default_gamma_for(draft: WorkerInfo | None) -> int:
    """4 draft tokens per round, or none without a draft.

    Measured here (SmolLM2-135M, CPU): verifying 5 tokens costs less than verifying 2 or 3, because the CPU matmul
    kernels change at 4 rows, so gamma 4 beats gamma 2 even for prompt lookup.
    """
    return 4 if draft is not None else 0


async def build_engine(
    workers: Workers, config: CoordinatorConfig, tokenizer_spec: str | None = None, tokenizer=None
) -> GenerationEngine:
    """Reads both workers' info, loads the target's tokenizer and refuses an incompatible pair."""
    target = await workers.target_info()
    draft = await workers.draft_info()
    if tokenizer is None:
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_spec or target.model_name)
    check_pair(target, draft, tokenizer.fingerprint)
    if config.default_num_speculative_tokens is None:
        config.default_num_speculative_tokens = default_gamma_for(draft)
    return GenerationEngine(workers, tokenizer, target, draft, config)


def advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]") else host


async def start_coordinator_server(
    engine: GenerationEngine, port: int = 0, host: str = "127.0.0.1"
) -> tuple[grpc.aio.Server, int]:
    server, health_servicer, bound = await create_server([SERVICE_NAME], port, host)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(engine), server)
    await server.start()
    engine.config.server_address, engine.config.server_port = host, bound
    await set_serving(health_servicer, [SERVICE_NAME], True)
    return server, bound


async def serve(
    target: str,
    draft: str | None,
    port: int,
    config: CoordinatorConfig,
    tokenizer: str | None = None,
    host: str = "0.0.0.0",
    startup_timeout: float = 600,
) -> None:
    await wait_until_serving(target, startup_timeout)
    if draft:
        await wait_until_serving(draft, startup_timeout)
    workers = GrpcWorkers(target, draft)
    config.server_address, config.server_port = advertised_host(host), port
    engine = await build_engine(workers, config, tokenizer)
    server, health_servicer, bound = await create_server([SERVICE_NAME], port, host)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(engine), server)
    await server.start()
    await set_serving(health_servicer, [SERVICE_NAME], True)
    log.info(
        "coordinator serving on port %d: target %s (%s), draft %s, gamma %d",
        bound,
        engine.target.model_name,
        target,
        engine.draft.model_name if engine.draft else "none",
        config.default_num_speculative_tokens,
    )
    await run_until_signalled(server, lambda: set_serving(health_servicer, [SERVICE_NAME], False))
    await workers.close()
