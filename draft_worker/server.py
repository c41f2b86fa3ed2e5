"""DraftService over gRPC: a thin servicer that turns stream messages into DraftEngine calls."""

import asyncio
import logging

import grpc

from common.errors import InvalidArgument
from common.models import load_model
from common.protocol import distribution_to_proto, info_to_proto, sampling_from_proto, timing_to_proto
from common.telemetry import run_traced
from common.server import abort_with, compute_executor, create_server, require_loaded, run_until_signalled, set_serving
from draft_worker.engine import DraftEngine
from draft_worker.ngram import is_ngram, parse_ngram
from specdec.v1 import draft_pb2, draft_pb2_grpc, worker_pb2

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
log = logging.getLogger("specdec.draft")


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: DraftEngine | None = None):
        self.engine = engine  # None while the model loads: calls are answered UNAVAILABLE
        self.executor = compute_executor()

    async def Draft(self, request_iterator, context):
        handle = None
        try:
            require_loaded(self.engine)
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if handle is None:
                    if kind != "start":
                        raise InvalidArgument("start", "the first message of a stream must open the session")
                    start = request.start
                    handle, cached, compute_us = await run_traced(
                        self.executor,
                        request.trace_context,
                        self.engine.open_session,
                        list(start.prompt_token_ids),
                        sampling_from_proto(start.sampling),
                        start.max_q_entries,
                    )
                    yield draft_pb2.DraftResponse(
                        started=worker_pb2.SessionStarted(
                            session_id=handle.session_id, cached_tokens=cached, timing=timing_to_proto(compute_us)
                        )
                    )
                    continue
                if kind != "step":
                    raise InvalidArgument("step", "the session is already open; send steps")
                step = request.step
                proposal = await run_traced(
                    self.executor,
                    request.trace_context,
                    self.engine.step,
                    handle,
                    step.num_accepted,
                    list(step.committed_token_ids),
                    step.num_tokens,
                )
                yield draft_pb2.DraftResponse(
                    proposal=draft_pb2.DraftProposal(
                        token_ids=proposal.token_ids,
                        distributions=[distribution_to_proto(d) for d in proposal.distributions],
                        timing=timing_to_proto(proposal.compute_us, proposal.sync_us),
                    )
                )
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)
        finally:
            if handle is not None:
                self.engine.close_session(handle)

    async def GetInfo(self, request, context):
        try:
            require_loaded(self.engine)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status, never a crash
            await abort_with(context, error)
        return info_to_proto(worker_pb2.WORKER_ROLE_DRAFT, self.engine.info())


def load_draft_engine(
    model: str, device: str = "cpu", dtype: str = "auto", max_sessions: int = 64, max_q_entries: int = 64
) -> DraftEngine:
    if is_ngram(model):
        return DraftEngine(None, model, ngram=parse_ngram(model), max_sessions=max_sessions, default_max_q_entries=max_q_entries)
    return DraftEngine(load_model(model, device, dtype), model, max_sessions=max_sessions, default_max_q_entries=max_q_entries)


async def serve(
    model: str,
    port: int,
    device: str = "cpu",
    dtype: str = "auto",
    max_sessions: int = 64,
    max_q_entries: int = 64,
    host: str = "0.0.0.0",
) -> None:
    servicer = DraftServicer()
    server, health_servicer, bound = await create_server([SERVICE_NAME], port, host)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    await server.start()
    log.info("draft worker listening on port %d, loading %s", bound, model)
    servicer.engine = await asyncio.to_thread(load_draft_engine, model, device, dtype, max_sessions, max_q_entries)
    await set_serving(health_servicer, [SERVICE_NAME], True)
    log.info("draft worker serving %s", model)
    await run_until_signalled(server, lambda: set_serving(health_servicer, [SERVICE_NAME], False))


async def start_draft_server(engine: DraftEngine, port: int = 0, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """An already-loaded engine served in the running event loop (used by tests and benchmarks)."""
    server, health_servicer, bound = await create_server([SERVICE_NAME], port, host)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(engine), server)
    await server.start()
    await set_serving(health_servicer, [SERVICE_NAME], True)
    return server, bound
