"""TargetService over gRPC: a thin servicer that turns stream messages into TargetEngine calls."""

import asyncio
import time

import grpc

from specdec.common.config import ServerOptions, WorkerConfig
from specdec.common.models import load_model
from specdec.common.protocol import (
    distribution_to_proto,
    logprob_to_proto,
    sampling_from_proto,
)
from specdec.common.rounds import WorkerTiming
from specdec.common.grpc_server import start_serving
from specdec.common.session_stream import SessionStreamServicer, serve_worker
from specdec.common.timing import elapsed_us
from specdec.v1 import target_pb2, worker_pb2
from specdec.target_worker.engine import AheadCall, PrefillCall, TargetEngine, VerifyCall

SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"]


class TargetServicer(SessionStreamServicer):
    role = worker_pb2.WORKER_ROLE_TARGET

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.running_ahead: dict[str, asyncio.Future] = {}  # session id -> its pending token's pass (decode ahead)

    async def open(self, request):
        start = request.start
        if start.sampling.grammar:  # compiled (and cached) off the event loop: the sessions beside it go on
            await asyncio.to_thread(self.engine.compile_grammar, start.sampling.grammar)
        session = self.engine.begin_session(
            list(start.prompt_token_ids),
            sampling_from_proto(start.sampling),
            start.num_p_entries,
            start.max_tokens,
            start.logprobs if start.HasField("logprobs") else None,
            start.prompt_logprobs,
        )
        try:
            opened = await self.batcher.submit(PrefillCall(session, self.parent(request)))
        except BaseException:
            self.engine.abandon(session)
            raise
        started = worker_pb2.SessionStarted(
            session_id=opened.session_id,
            cached_tokens=opened.cached_tokens,
            reused_tokens=opened.reused_tokens,
            timing=WorkerTiming(opened.compute_us, queue_us=opened.queue_us).to_proto(),
            prompt_logprobs=[logprob_to_proto(e) for e in opened.prompt_logprobs],
        )
        return session, target_pb2.VerifyResponse(started=started)

    async def step(self, session, request):
        step = request.step
        if step.decode_ahead:
            self.engine.check_decode_ahead(session)
        # Checked and converted by the call itself (VerifyCall.check), once, on the compute thread.
        call = VerifyCall(session, list(step.draft_token_ids), list(step.draft_distributions), self.parent(request))
        waited_us = await self.ahead_of(session)
        if session.ahead is not None and not call.draft_tokens:
            # Scored ahead: decided at once with no pass, on the compute thread like every engine call.
            verdict = await self.run(request, self.engine.verify, session, [], [])
        else:
            verdict = await self.batcher.submit(call)
        verdict.timing.ahead_us = max(0, verdict.timing.ahead_us - waited_us)
        if step.decode_ahead:
            self.decode_ahead(session, request)
        return target_pb2.VerifyResponse(
            result=target_pb2.VerifyResult(
                num_accepted=verdict.num_accepted,
                next_token_id=verdict.next_token,
                rollback=verdict.rollback,
                draft_token_probs=verdict.draft_token_probs,
                distributions=[distribution_to_proto(d) for d in verdict.distributions],
                logprobs=[logprob_to_proto(e) for e in verdict.logprobs],
                timing=verdict.timing.to_proto(),
            )
        )

    def decode_ahead(self, session, request) -> None:
        """Feeds the session's pending token now, in the batcher's next pass, without waiting for its next step."""
        running = self.batcher.enqueue(AheadCall(session, self.parent(request)))
        # Its error, if any, is the next step's; one that never comes (the stream ended) must not leave it unread.
        running.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.running_ahead[session.session_id] = running

    async def ahead_of(self, session) -> int:
        """Waits for the session's pass running ahead, if any (its error is this step's); how long it waited (us)."""
        running = self.running_ahead.pop(session.session_id, None)
        if running is None:
            return 0
        start = time.perf_counter()
        await running
        return elapsed_us(start)

    @staticmethod
    def timing(response):
        return response.result.timing

    def close(self, session) -> None:
        running = self.running_ahead.pop(session.session_id, None)
        if running is not None:
            running.cancel()
        self.engine.close_session(session)

    Verify = SessionStreamServicer.session_stream  # the one stream protocol of both workers


async def serve(config: WorkerConfig, options: ServerOptions) -> None:
    servicer = TargetServicer(idle_timeout=options.session_idle_timeout)

    def load_engine() -> TargetEngine:
        loaded = load_model(config.model, config.device, config.dtype, config.linear, config.engine)
        return TargetEngine(
            loaded,
            config.max_sessions,
            max_kv_tokens=config.max_kv_tokens,
            max_prefill_tokens=config.max_prefill_tokens_per_pass,
            prefix_cache_tokens=config.prefix_cache_tokens,
        )

    await serve_worker(SERVICE, servicer, load_engine, config.model, options, config.worker_auth_token)


async def start_target_server(
    engine: TargetEngine, options: ServerOptions | None = None, token: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """An already-loaded engine served in the running event loop (used by tests and benchmarks)."""
    options = options or ServerOptions(host="127.0.0.1")
    server, _, bound = await start_serving(SERVICE, TargetServicer(engine, options.session_idle_timeout), options, token=token)
    return server, bound
