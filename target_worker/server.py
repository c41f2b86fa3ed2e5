"""TargetService over gRPC: a thin servicer that turns stream messages into TargetEngine calls."""

import asyncio
import logging

import grpc

from common.errors import InvalidArgument
from common.models import load_model
from common.protocol import distribution_from_proto, distribution_to_proto, info_to_proto, sampling_from_proto, timing_to_proto
from common.telemetry import run_traced
from common.server import abort_with, require_loaded, compute_executor, create_server, run_until_signalled, set_serving
from specdec.v1 import target_pb2, target_pb2_grpc, worker_pb2
from target_worker.engine import TargetEngine

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
log = logging.getLogger("specdec.target")


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine | None = None):
        self.engine = engine  # None while the model loads: calls are answered UNAVAILABLE
        self.executor = compute_executor()

    async def Verify(self, request_iterator, context):
        session = None
        try:
            require_loaded(self.engine)
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if session is None:
                    if kind != "start":
                        raise InvalidArgument("start", "the first message of a stream must open the session")
                    start = request.start
                    session, opened = await run_traced(
                        self.executor,
                        request.trace_context,
                        self.engine.open_session,
                        list(start.prompt_token_ids),
                        sampling_from_proto(start.sampling),
                        start.num_p_entries,
                    )
                    yield target_pb2.VerifyResponse(
                        started=worker_pb2.SessionStarted(
                            session_id=opened.session_id,
                            cached_tokens=opened.cached_tokens,
                            timing=timing_to_proto(opened.compute_us),
                        )
                    )
                    continue
                if kind != "step":
                    raise InvalidArgument("step", "the session is already open; send steps")
                step = request.step
                outcome = await run_traced(
                    self.executor,
                    request.trace_context,
                    self.engine.verify,
                    session,
                    list(step.draft_token_ids),
                    [distribution_from_proto(d) for d in step.draft_distributions],
                )
                yield target_pb2.VerifyResponse(
                    result=target_pb2.VerifyResult(
                        num_accepted=outcome.num_accepted,
                        next_token_id=outcome.next_token,
                        rollback=outcome.rollback,
                        draft_token_probs=outcome.draft_token_probs,
                        distributions=[distribution_to_proto(d) for d in outcome.distributions],
                        timing=timing_to_proto(outcome.compute_us, outcome.sync_us),
                    )
                )
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)
        finally:
            if session is not None:
                self.engine.close_session(session)

    async def GetInfo(self, request, context):
        try:
            require_loaded(self.engine)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)
        return info_to_proto(worker_pb2.WORKER_ROLE_TARGET, self.engine.info())


async def serve(
    model: str, port: int, device: str = "cpu", dtype: str = "auto", max_sessions: int = 64, host: str = "0.0.0.0"
) -> None:
    servicer = TargetServicer()
    server, health_servicer, bound = await create_server([SERVICE_NAME], port, host)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    await server.start()
    log.info("target worker listening on port %d, loading %s", bound, model)
    loaded = await asyncio.to_thread(load_model, model, device, dtype)
    servicer.engine = TargetEngine(loaded, max_sessions)
    await set_serving(health_servicer, [SERVICE_NAME], True)
    log.info("target worker serving %s on %s (%s)", model, loaded.device, loaded.dtype)
    await run_until_signalled(server, lambda: set_serving(health_servicer, [SERVICE_NAME], False))


async def start_target_server(engine: TargetEngine, port: int = 0, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """An already-loaded engine served in the running event loop (used by tests and benchmarks)."""
    server, health_servicer, bound = await create_server([SERVICE_NAME], port, host)
    target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(engine), server)
    await server.start()
    await set_serving(health_servicer, [SERVICE_NAME], True)
    return server, bound
