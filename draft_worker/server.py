"""DraftService over gRPC: a thin servicer that turns stream messages into DraftEngine calls."""

import asyncio

import grpc

from specdec.common.config import DraftWorkerConfig, ServerOptions
from specdec.common.models import load_model
from specdec.common.protocol import DRAFT_SOURCES, distribution_to_proto, sampling_from_proto
from specdec.common.grpc_server import start_serving
from specdec.common.rounds import WorkerTiming
from specdec.common.session_stream import SessionStreamServicer, serve_worker
from specdec.draft_worker.engine import DraftCall, DraftEngine
from specdec.draft_worker.hybrid import HybridProposer
from specdec.draft_worker.model_proposer import ModelProposer
from specdec.draft_worker.ngram import PromptLookupProposer
from specdec.draft_worker.proposer import Proposer
from specdec.draft_worker.specs import is_ngram, is_model_free, split_hybrid
from specdec.draft_worker.suffix import SuffixProposer
from specdec.v1 import draft_pb2, worker_pb2

SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]


def abandon_begun(engine: DraftEngine):
    """A done-callback that frees the session a cancelled opening's begin_session reserved."""

    def abandon(beginning: asyncio.Future) -> None:
        if not beginning.cancelled() and beginning.exception() is None:
            engine.abandon(beginning.result())

    return abandon


class DraftServicer(SessionStreamServicer):
    role = worker_pb2.WORKER_ROLE_DRAFT

    async def open(self, request):
        start = request.start
        engine = self.engine
        if start.sampling.grammar:
            await asyncio.to_thread(engine.proposer.prepare, sampling_from_proto(start.sampling))
        beginning = asyncio.ensure_future(
            self.run(
                request,
                engine.begin_session,
                list(start.prompt_token_ids),
                sampling_from_proto(start.sampling),
                start.max_q_entries,
                start.max_tokens,
            )
        )
        try:
            # On the compute thread (prompt lookup's index is built there): a cancellation meanwhile still
            # releases the reservation it makes.
            handle = await asyncio.shield(beginning)
        except asyncio.CancelledError:
            beginning.add_done_callback(abandon_begun(engine))
            raise
        try:
            # One compute-thread task per chunk: the batched steps of the other sessions run in between.
            while not await self.run(request, engine.prefill_chunk, handle):
                pass
            engine.finish_opening(handle)
        except BaseException:
            engine.abandon(handle)
            raise
        started = worker_pb2.SessionStarted(
            session_id=handle.session_id,
            cached_tokens=handle.state.cached,
            timing=WorkerTiming(handle.prefill_us).to_proto(),
            reused_tokens=getattr(handle.state, "reused_tokens", None) or 0,  # a model draft's, from its prefix cache
        )
        return handle, draft_pb2.DraftResponse(started=started)

    async def step(self, handle, request):
        step = request.step
        call = DraftCall(
            handle, step.num_accepted, list(step.committed_token_ids), step.num_tokens, step.assume_accepted, self.parent(request)
        )
        if not self.engine.proposer.batched:
            # A model-free proposer takes microseconds: less than handing the call to the compute thread and back,
            # and there is no forward pass to share with other sessions.
            proposal = self.engine.run_batch([call])[0]
            if isinstance(proposal, Exception):
                raise proposal
        else:
            proposal = await self.batcher.submit(call)
        return draft_pb2.DraftResponse(
            proposal=draft_pb2.DraftProposal(
                token_ids=proposal.token_ids,
                distributions=[distribution_to_proto(d) for d in proposal.distributions],
                timing=proposal.timing.to_proto(),
                assumed_token_id=proposal.assumed_token,
                source=DRAFT_SOURCES[proposal.source],
                confidence=proposal.confidence,
            )
        )

    @staticmethod
    def timing(response):
        return response.proposal.timing

    def close(self, handle) -> None:
        self.engine.close_session(handle)

    Draft = SessionStreamServicer.session_stream  # the one stream protocol of both workers


def load_proposer(config: DraftWorkerConfig) -> Proposer:
    """The proposer a --model spec names: ngram[:...] (prompt lookup), suffix[:...] (suffix trees),
    suffix[:...]+MODEL (suffix trees first, then the model), or a model spec."""
    spec = config.model
    if is_model_free(spec):
        return model_free_proposer(spec)
    suffix_spec, model_spec = split_hybrid(spec)
    loaded = load_model(model_spec, config.device, config.dtype, config.linear, config.engine)
    model = ModelProposer(loaded, prefix_cache_tokens=config.prefix_cache_tokens)
    return HybridProposer(SuffixProposer.from_spec(suffix_spec), model) if suffix_spec else model


def model_free_proposer(spec: str) -> Proposer:
    """The proposer of an ngram[:...] or suffix[:...] spec (InvalidArgument naming `model` for a malformed one)."""
    return PromptLookupProposer.from_spec(spec) if is_ngram(spec) else SuffixProposer.from_spec(spec)


def load_draft_engine(config: DraftWorkerConfig) -> DraftEngine:
    return DraftEngine(
        load_proposer(config),
        config.model,
        max_sessions=config.max_sessions,
        default_max_q_entries=config.max_q_entries,
        max_kv_tokens=config.max_kv_tokens,
        max_prefill_tokens=config.max_prefill_tokens_per_pass,
    )


async def serve(config: DraftWorkerConfig, options: ServerOptions) -> None:
    servicer = DraftServicer(idle_timeout=options.session_idle_timeout)
    await serve_worker(SERVICE, servicer, lambda: load_draft_engine(config), config.model, options, config.worker_auth_token)


async def start_draft_server(
    engine: DraftEngine, options: ServerOptions | None = None, token: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """An already-loaded engine served in the running event loop (used by tests and benchmarks)."""
    options = options or ServerOptions(host="127.0.0.1")
    server, _, bound = await start_serving(SERVICE, DraftServicer(engine, options.session_idle_timeout), options, token=token)
    return server, bound
