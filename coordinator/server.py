"""GenerationService over gRPC: a thin servicer over GenerationEngine, admission (authentication and the
concurrent-request cap), and the coordinator's start-up checks."""

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health

from specdec.common.models import load_tokenizer
from specdec.common.config import ServerOptions
from specdec.common.grpc_errors import reports_errors, retries_spent
from specdec.common.grpc_server import start_serving
from specdec.common.lifecycle import FINAL_STOP_SECONDS, run_until_signalled
from specdec.common.services import check_parsed
from specdec.common.telemetry import context_from
from specdec.common.config import ConfigError
from specdec.common.errors import InvalidArgument
from specdec.draft_worker.engine import DraftEngine
from specdec.draft_worker.server import model_free_proposer
from specdec.draft_worker.specs import is_model_free
from specdec.coordinator.admission import Admission
from specdec.coordinator.config import CoordinatorConfig, CoordinatorServerConfig, HttpSettings, PoolSettings
from specdec.coordinator.engine import GenerationEngine, check_pair
from specdec.coordinator.gamma_policy_factory import PolicyFactory, gamma_policy_for
from specdec.coordinator.pool_status import status_of
from specdec.coordinator.requests import params_of, response_of, stream_message_of
from specdec.coordinator.local_draft import LocalDraftWorkers
from specdec.coordinator.worker_clients import GrpcWorkers
from specdec.coordinator.workers import WorkerInfo, Workers
from specdec.v1 import generation_pb2

if TYPE_CHECKING:
    from specdec.coordinator.http_api import HttpServer

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
# A client's connection is closed after a few minutes (its calls in progress finish first), so that a client that
# balances over every coordinator a name resolves to (round_robin over dns:///) resolves again and reaches the
# coordinators added since: gRPC re-resolves a name only when a connection ends.
CONNECTION_AGE = (("grpc.max_connection_age_ms", 300_000), ("grpc.max_connection_age_grace_ms", 3_600_000))
log = logging.getLogger("specdec.coordinator")


def client_trace_context(context: grpc.aio.ServicerContext):
    """The caller's trace context from the call's metadata (traceparent), so the request's trace continues it."""
    return context_from((key, value) for key, value in context.invocation_metadata() or ())


class GenerationServicer:
    def __init__(self, engine: GenerationEngine, admission: Admission):
        self.engine = engine
        self.admission = admission

    @contextlib.asynccontextmanager
    async def admitted(self, request):
        """Checks capacity before any work (credentials were checked before the call began: common.auth); holds a
        request slot while the request runs. A refusal at admission (draining) is for the client to retry
        elsewhere; a request that ran has already had its retries on the workers (retries_spent)."""
        check_parsed(request)
        with self.admission.slot():
            params = await params_of(request, self.engine.tokenizer, self.engine.config)
            with retries_spent():
                yield params

    @reports_errors
    async def Generate(self, request, context):
        async with self.admitted(request) as params:
            result = await self.engine.generate_all(params, client_trace_context(context), context.time_remaining())
            return response_of(result, request.include_rounds)

    @reports_errors
    async def GenerateStream(self, request, context):
        async with self.admitted(request) as params:
            async for event in self.engine.generate(params, client_trace_context(context), context.time_remaining()):
                yield stream_message_of(event, request.include_rounds)

    @reports_errors
    async def GetStatus(self, request, context):
        engine = self.engine
        draft = engine.draft.model_name if engine.draft else ""
        return status_of(engine.workers.status(), self.admission.active, engine.target.model_name, draft)


def default_gamma_for(has_draft: bool) -> int:
    """Auto (-1: chosen each round from the measured costs and acceptance), or no speculation without a draft."""
    return -1 if has_draft else 0


async def build_engine(
    workers: Workers,
    config: CoordinatorConfig,
    tokenizer_spec: str | None = None,
    tokenizer=None,
    draft_timeout: float = 10.0,
    policy_for: PolicyFactory = gamma_policy_for,
) -> GenerationEngine:
    """Reads the workers' info, loads the target's tokenizer and refuses workers that do not share it.

    A target must answer; a draft worker that does not is connected later, by the first requests after it is up.
    policy_for: each request's gamma policy (the engine's seam for a policy of one's own).
    """
    if tokenizer is None and tokenizer_spec:
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_spec)
    if tokenizer is not None:  # given: the workers that fit it are the deployment
        await workers.accept_tokenizer(tokenizer.fingerprint)
    target = await workers.target_info()
    if tokenizer is None:  # the first target worker's model says which tokenizer the deployment has
        tokenizer = await asyncio.to_thread(load_tokenizer, target.model_name)
        check_pair(target, None, tokenizer.fingerprint)
        await workers.accept_tokenizer(tokenizer.fingerprint)
    draft: WorkerInfo | None = None
    if workers.has_draft:
        try:
            draft = await asyncio.wait_for(workers.draft_info(), draft_timeout)
        except Exception as error:  # noqa: BLE001 - the coordinator serves target-only until the draft is up
            log.warning("draft worker not reachable at start-up (%s); serving target-only until it is", error)
    if config.default_num_speculative_tokens is None:  # the caller's config stays as given
        config = replace(config, default_num_speculative_tokens=default_gamma_for(workers.has_draft))
    return GenerationEngine(workers, tokenizer, target, draft, config, policy_for)


def advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]") else host


@dataclass
class Coordinator:
    """A running coordinator's servers: GenerationService over gRPC and, when asked, the OpenAI HTTP API."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    admission: Admission
    http: "HttpServer | None" = None
    http_port: int | None = None
    http_task: asyncio.Task | None = None

    async def stop_http(self) -> None:
        if self.http is not None:
            await self.http.stop(self.http_task)

    async def stop(self) -> None:
        await self.stop_http()
        await self.server.stop(FINAL_STOP_SECONDS)


async def launch(
    engine: GenerationEngine,
    options: ServerOptions,
    max_concurrent_requests: int = CoordinatorServerConfig.max_concurrent_requests,
    auth_token: str | None = None,
    http_port: int | None = None,
    http: HttpSettings | None = None,
) -> Coordinator:
    """Serves the engine in the running event loop: gRPC on options.port and, with http_port, the OpenAI API; both
    share one admission (the concurrent-request cap, the token, draining)."""
    admission = Admission(max_concurrent_requests, auth_token)
    # The token is checked by the server's interceptor, before a call's request is read (common.auth).
    server, health_servicer, bound = await start_serving(
        SERVICE, GenerationServicer(engine, admission), options, CONNECTION_AGE, token=auth_token
    )
    engine.listening_on(advertised_host(options.host), bound)
    coordinator = Coordinator(server, health_servicer, bound, admission)
    if http_port is not None:
        from specdec.coordinator.http_api import build_app, start_http  # FastAPI and uvicorn only where the API is served

        try:
            http = http or HttpSettings()
            app = build_app(engine, admission, http)
            coordinator.http, coordinator.http_port, coordinator.http_task = await start_http(
                app, options.host, http_port, options.tls, http
            )
        except BaseException:
            await server.stop(0)
            raise
    return coordinator


async def start_coordinator_server(
    engine: GenerationEngine,
    options: ServerOptions | None = None,
    max_concurrent_requests: int = CoordinatorServerConfig.max_concurrent_requests,
    auth_token: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """The GenerationService over an engine, in the running event loop (used by tests and benchmarks)."""
    coordinator = await launch(engine, options or ServerOptions(host="127.0.0.1"), max_concurrent_requests, auth_token)
    return coordinator.server, coordinator.port


async def connect_workers(settings: CoordinatorServerConfig, pools: PoolSettings | None = None) -> "Workers":
    """The configured workers once a target answers: the draft on draft workers, or run here (--local-draft, or
    --model-free-draft-here when the draft workers' draft is model-free)."""
    workers = GrpcWorkers(settings.target, settings.draft, settings.worker_tls, pools, settings.worker_auth_token)
    if settings.local_draft:
        try:
            proposer = model_free_proposer(settings.local_draft)
        except InvalidArgument as error:
            raise ConfigError(f"--local-draft {settings.local_draft}: {error}") from None
        workers = LocalDraftWorkers(workers, DraftEngine(proposer, settings.local_draft))
    await workers.target_info(settings.startup_timeout)
    if workers.has_draft:
        # The draft gets a little longer than the target to come up; after that the coordinator starts without it.
        with contextlib.suppress(Exception):
            draft = await workers.draft_info(settings.draft_startup_timeout)
            if settings.model_free_draft_here and is_model_free(draft.model_name):
                workers = drafting_here(workers, draft.model_name)
    return workers


def drafting_here(workers: GrpcWorkers, spec: str) -> LocalDraftWorkers:
    """The draft workers' model-free draft, run in this process with the workers' own spec: the same proposals
    without an exchange with a draft worker each round. The draft workers are left unused."""
    log.info("draft workers serve the model-free draft %s: running it in this process", spec)
    return LocalDraftWorkers(workers, DraftEngine(model_free_proposer(spec), spec))


async def serve(
    settings: CoordinatorServerConfig,
    options: ServerOptions,
    config: CoordinatorConfig,
    pools: PoolSettings | None = None,
    http: HttpSettings | None = None,
) -> None:
    """Runs the coordinator until SIGTERM: waits for a target worker (and briefly a draft), checks the workers'
    tokenizers, then serves. settings.target is required."""
    workers = await connect_workers(settings, pools)
    engine = await build_engine(workers, config, settings.tokenizer)
    coordinator = await launch(engine, options, settings.max_concurrent_requests, settings.auth_token, settings.http_port, http)
    log.info(
        "coordinator serving on port %d%s: target %s (%s), draft %s (%s), gamma %d",
        coordinator.port,
        f" (OpenAI HTTP API on port {coordinator.http_port})" if coordinator.http else "",
        engine.target.model_name,
        ", ".join(workers.target_pool.configured),
        engine.draft.model_name if engine.draft else "not connected yet" if workers.has_draft else "none",
        ", ".join(workers.draft_pool.configured) if workers.draft_pool else "in this process" if workers.has_draft else "-",
        engine.config.default_num_speculative_tokens,
    )
    await run_until_signalled(
        coordinator.server, coordinator.health, [SERVICE.full_name], options.grace_period, coordinator.admission.lifecycle
    )
    await coordinator.stop_http()  # the drain above waited for its requests too (one admission)
    await workers.close()
