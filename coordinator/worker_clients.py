"""Workers over gRPC: each session is one bidirectional stream (DraftService.Draft, TargetService.Verify)."""

import asyncio
import functools
import time
from collections.abc import Callable

import grpc
from opentelemetry import propagate
from opentelemetry.context import Context

from specdec.common.auth import token_interceptors
from specdec.common.errors import InvalidArgument, ResourceExhausted, Unavailable, WorkerFailed
from specdec.common.protocol import (
    DRAFT_SOURCE_OF,
    distribution_from_proto,
    distribution_to_proto,
    logprob_from_proto,
    sampling_to_proto,
)
from specdec.common.rounds import DraftQ, DraftSource, Proposal, Verdict, WorkerTiming
from specdec.common.sampling import SamplingParams, SparseDistribution
from specdec.common.grpc_options import CHANNEL_OPTIONS
from specdec.common.tls import TlsFiles, channel_credentials
from specdec.common.timing import elapsed_us
from specdec.coordinator.addresses import parse_addresses
from specdec.coordinator.config import PoolSettings
from specdec.coordinator.pool import Health, Member, WorkerPool, identity
from specdec.coordinator.workers import IncompatibleWorkers, WorkerInfo
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc, worker_pb2

INFO_FIELDS = [f.name for f in worker_pb2.GetInfoResponse.DESCRIPTOR.fields if f.name != "role"]


def info_from_proto(msg: worker_pb2.GetInfoResponse) -> WorkerInfo:
    fields = {name: getattr(msg, name) for name in INFO_FIELDS}
    fields["eos_token_ids"] = list(msg.eos_token_ids)
    fields["forward_costs"] = [(c.tokens, c.milliseconds) for c in msg.forward_costs]
    return WorkerInfo(**fields)


# How gRPC core reports a stream whose call failed under a write, as when the worker stopped and cut it (its grace
# period ran out while it drained): treated as the worker going away, as UNAVAILABLE is, so that the session is
# reopened on another worker. A worker that keeps failing this way is tried a bounded number of times per request
# (CoordinatorConfig.max_target_retries).
CUT_BY_SERVER = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def error_from_rpc(error: grpc.aio.AioRpcError, worker: str) -> Exception:
    return error_from_status(error.code(), error.details(), worker)


def error_from_status(code: grpc.StatusCode, details: str | None, worker: str) -> Exception:
    """A worker's failure as the coordinator's own error, saying which worker failed and how.

    Only transport-level failures (UNAVAILABLE, a worker gone or restarting) are Unavailable, which the coordinator
    retries; an error the worker itself reports is not retried.
    """
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(worker, details or "rejected")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"{worker} worker: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (code, details) == CUT_BY_SERVER:
        return Unavailable(f"{worker} worker: {details or code.name}")
    return WorkerFailed(f"{worker} worker failed: {code.name}: {details}")


def wire_form(dist: DraftQ) -> worker_pb2.SparseDistribution:
    """q as the target receives it. A proposal that came over gRPC holds its q as received, so that it travels
    on without a round of conversions to tensors and back."""
    return dist if isinstance(dist, worker_pb2.SparseDistribution) else distribution_to_proto(dist)


class StreamSession:
    """One bidirectional stream used as request/response pairs, on one member of a worker pool."""

    worker = "worker"
    rpc = ""  # the stub's method that opens the stream

    def __init__(self, call, member: Member | None = None):
        self.call = call
        self.member = member
        # What the session's output depends on (see pool.identity): a reopened session keeps it.
        self.identity = identity(member.info) if member is not None and member.info is not None else None
        self.prefill_us = 0
        self.opening_overhead_us = 0  # the opening's round trip beyond the worker's work and waiting (its transport)
        # A stream to a member not known to be usable waits for the worker to be ready: its opening's round trip then
        # holds the reconnection too, and says nothing of the transport.
        self.waited_for_ready = member is not None and not member.usable
        self.interrupted = False  # an exchange was cancelled between its write and its read
        if member is not None:
            member.acquire()

    def release(self) -> None:
        """Gives the session's place on its member back (once)."""
        if self.member is not None:
            self.member.release()
            self.member = None

    def abandon(self) -> None:
        self.call.cancel()
        self.release()

    async def exchange(self, request, parent: Context | None):
        """Sends one message carrying the parent span's trace context; returns the answer and both sizes in bytes."""
        if parent is not None:
            propagate.inject(request.trace_context, context=parent)
        try:
            await self.call.write(request)
            response = await self.call.read()
        except asyncio.CancelledError:
            self.interrupted = True
            raise
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error, self.worker) from None
        except asyncio.InvalidStateError:
            # The worker ended the stream (e.g. it died) before this write: report how the call ended.
            response = grpc.aio.EOF
        if response is grpc.aio.EOF:
            raise error_from_status(await self.call.code(), await self.call.details(), self.worker)
        return response, request.ByteSize(), response.ByteSize()

    async def close(self) -> None:
        """Half-closes the stream so that the worker frees the session, and waits for it to finish. A stream whose
        last exchange was interrupted is cancelled instead: its unread answer can keep it from finishing."""
        try:
            await self.finish()
        finally:
            self.release()

    async def finish(self) -> None:
        if self.interrupted:
            self.call.cancel()
            return
        try:
            await self.call.done_writing()
            await asyncio.wait_for(self.call.code(), timeout=5)
        except asyncio.CancelledError:
            self.call.cancel()
            # grpc.aio raises CancelledError for a call that was already cancelled; only this task's own
            # cancellation must propagate.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
        except Exception:  # the stream already failed, or the worker is slow to finish: drop it
            self.call.cancel()


class GrpcTargetSession(StreamSession):
    worker = "target"
    rpc = "Verify"

    def __init__(self, call, member: Member | None = None):
        super().__init__(call, member)
        # Read now: the session gives its member back when it ends. Unknown (not yet polled): not asked.
        self.decodes_ahead = bool(member is not None and member.info is not None and member.info.decodes_ahead)

    async def open(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int,
        parent: Context | None,
        max_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> "GrpcTargetSession":
        start = target_pb2.VerifySessionStart(
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
            num_p_entries=num_p_entries,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        sent = time.perf_counter()
        response, _, _ = await self.exchange(target_pb2.VerifyRequest(start=start), parent)
        timing = response.started.timing
        self.prefill_us = timing.compute_us
        self.reused_tokens = response.started.reused_tokens
        self.prompt_logprobs = [logprob_from_proto(e) for e in response.started.prompt_logprobs]
        if not self.waited_for_ready:
            self.opening_overhead_us = max(0, elapsed_us(sent) - timing.compute_us - timing.queue_us)
        return self

    async def verify(
        self,
        draft_tokens: list[int],
        draft_dists: list[SparseDistribution],
        parent: Context | None = None,
        decode_ahead: bool = False,
    ) -> Verdict:
        step = target_pb2.VerifyStep(
            draft_token_ids=draft_tokens, draft_distributions=[wire_form(d) for d in draft_dists], decode_ahead=decode_ahead
        )
        response, sent, received = await self.exchange(target_pb2.VerifyRequest(step=step), parent)
        result = response.result
        return Verdict(
            num_accepted=result.num_accepted,
            next_token=result.next_token_id,
            rollback=result.rollback,
            draft_token_probs=list(result.draft_token_probs),
            distributions=[distribution_from_proto(d) for d in result.distributions],
            logprobs=[logprob_from_proto(e) for e in result.logprobs],
            timing=WorkerTiming.from_proto(result.timing),
            bytes_sent=sent,
            bytes_received=received,
        )


class GrpcDraftSession(StreamSession):
    worker = "draft"
    rpc = "Draft"

    async def open(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int, parent: Context | None, max_tokens: int = 0
    ) -> "GrpcDraftSession":
        start = draft_pb2.DraftSessionStart(
            prompt_token_ids=prompt, sampling=sampling_to_proto(params), max_q_entries=max_q_entries, max_tokens=max_tokens
        )
        response, _, _ = await self.exchange(draft_pb2.DraftRequest(start=start), parent)
        self.prefill_us = response.started.timing.compute_us
        return self

    async def step(
        self,
        num_accepted: int,
        committed: list[int],
        num_tokens: int,
        parent: Context | None = None,
        assume_accepted: bool = False,
    ) -> Proposal:
        step = draft_pb2.DraftStep(
            num_accepted=num_accepted, committed_token_ids=committed, num_tokens=num_tokens, assume_accepted=assume_accepted
        )
        response, sent, received = await self.exchange(draft_pb2.DraftRequest(step=step), parent)
        proposal = response.proposal
        return Proposal(
            token_ids=list(proposal.token_ids),
            distributions=list(proposal.distributions),  # passed on to the target as received
            timing=WorkerTiming.from_proto(proposal.timing),
            bytes_sent=sent,
            bytes_received=received,
            assumed_token=proposal.assumed_token_id if proposal.HasField("assumed_token_id") else None,
            source=DRAFT_SOURCE_OF.get(proposal.source, DraftSource.NONE),
            confidence=list(proposal.confidence),
        )


def open_channel(
    address: str, tls: TlsFiles | None, server_name: str | None = None, token: str | None = None
) -> grpc.aio.Channel:
    """A channel to a worker: mutual TLS when certificate files are given, plain otherwise; every call carries the
    worker token when there is one. server_name: the name the worker's certificate must carry, when the address is
    an IP resolved from that name."""
    interceptors = token_interceptors(token)
    if tls is not None and tls.enabled:
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name)] if server_name else CHANNEL_OPTIONS
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


def accepts_tokenizer(fingerprint: str, model_free_fits: bool) -> Callable[[WorkerInfo], str]:
    """A pool's test of a member's tokenizer: why the member does not fit ('' if it does). A model-free draft
    (no fingerprint) works on token ids and fits any tokenizer."""

    def refusal(info: WorkerInfo) -> str:
        if info.tokenizer_fingerprint == fingerprint or (model_free_fits and not info.tokenizer_fingerprint):
            return ""
        return (
            f"it and the deployment use different tokenizers (fingerprints {info.tokenizer_fingerprint or 'none'} and "
            f"{fingerprint}); speculative decoding needs every worker to share one vocabulary"
        )

    return refusal


class GrpcWorkers:
    """Pools of target workers and, optionally, draft workers; a session is placed on one member when it opens.

    target, draft: an address, several (a list, or comma-separated), or one dns:///name:port target.
    """

    def __init__(
        self,
        target: str | list[str],
        draft: str | list[str] | None,
        tls: TlsFiles | None = None,
        settings: PoolSettings | None = None,
        token: str | None = None,
    ):
        """token: the workers' --worker-auth-token, sent on every call."""
        opener = functools.partial(open_channel, token=token)

        def pool(role: str, addresses: list[str], stub_class) -> WorkerPool:
            return WorkerPool(role, addresses, opener, stub_class, info_from_proto, tls, settings)

        self.target_pool = pool("target", parse_addresses(target), target_pb2_grpc.TargetServiceStub)
        draft_addresses = parse_addresses(draft)
        self.draft_pool = pool("draft", draft_addresses, draft_pb2_grpc.DraftServiceStub) if draft_addresses else None
        self.has_draft = self.draft_pool is not None
        self.pools = [p for p in (self.target_pool, self.draft_pool) if p is not None]

    async def target_info(self, timeout: float | None = None) -> WorkerInfo:
        return await self.target_pool.info(timeout)

    async def draft_info(self, timeout: float | None = None) -> WorkerInfo | None:
        return await self.draft_pool.info(timeout) if self.draft_pool else None

    def draft_available(self) -> bool:
        if self.draft_pool is None:
            return False
        self.draft_pool.start()
        return bool(self.draft_pool.usable())

    async def accept_tokenizer(self, fingerprint: str) -> None:
        """From now on each pool takes only members with this tokenizer; refuses to start when no target fits,
        or when draft workers answer and none fits."""
        self.target_pool.accept = accepts_tokenizer(fingerprint, model_free_fits=False)
        await self.target_pool.recheck()
        if self.draft_pool is not None:
            self.draft_pool.accept = accepts_tokenizer(fingerprint, model_free_fits=True)
            await self.draft_pool.recheck()
        for pool in self.pools:
            refused = [m for m in pool.members.values() if m.health is Health.REFUSED]
            if refused and not pool.usable():
                first = refused[0]
                raise IncompatibleWorkers(f"no {pool.role} worker fits: {first.address} ({first.info.model_name}) {first.detail}")

    def failed(self, session: StreamSession, detail: str) -> None:
        """A session failed or missed its deadline: its member gets no new sessions for a while."""
        if session.member is not None:
            session.member.failed(detail)

    def status(self) -> list[WorkerPool]:
        return self.pools

    async def open_target(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_p_entries: int,
        parent: Context | None = None,
        like: GrpcTargetSession | None = None,
        max_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> GrpcTargetSession:
        """like: the failed session this one replaces; the new one goes to a worker of the same model and numerics.
        A pool with no healthy member still tries one that may be restarting or recovering, waiting for it to be
        ready (within the caller's timeout) rather than failing at once."""
        same_as = like.identity if like is not None else None
        return await open_on_pool(
            self.target_pool,
            GrpcTargetSession,
            lambda s: s.open(prompt, params, num_p_entries, parent, max_tokens, logprobs, prompt_logprobs),
            True,
            same_as,
        )

    async def open_draft(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_q_entries: int,
        parent: Context | None = None,
        timeout: float | None = None,
        max_tokens: int = 0,
    ) -> GrpcDraftSession:
        """timeout: what each draft worker gets to open the session; one that misses it is backed off, as a
        failed one is, and the next is tried."""
        return await open_on_pool(
            self.draft_pool,
            GrpcDraftSession,
            lambda s: s.open(prompt, params, max_q_entries, parent, max_tokens),
            timeout=timeout,
        )

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools))


async def open_on_pool(
    pool: WorkerPool, session_class, opening, fallback: bool = False, same_as: tuple | None = None, timeout: float | None = None
):
    """Opens a session on the pool's least-loaded member. A member that fails to open it (or misses the timeout) is
    marked failed, and a full one skipped, and the next one tried, until each was tried once."""
    pool.start()
    tried: set[str] = set()
    last_error: Exception | None = None
    while True:
        try:
            member = pool.pick(tried, fallback=fallback, same_as=same_as)
        except Unavailable:
            if last_error is not None:
                raise last_error from None
            raise
        tried.add(member.address)
        session = session_class(getattr(member.stub, session_class.rpc)(wait_for_ready=not member.usable), member)
        try:
            async with asyncio.timeout(timeout):
                opened = await opening(session)
        except (Unavailable, TimeoutError) as error:
            session.abandon()
            detail = str(error) or f"did not open a session within {timeout} s"
            member.failed(detail)
            last_error = (
                error if isinstance(error, Unavailable) else Unavailable(f"{pool.role} worker {member.address}: {detail}")
            )
            continue
        except ResourceExhausted as error:
            session.abandon()
            last_error = error
            continue
        except BaseException:
            session.abandon()
            raise
        member.backoff.succeeded()
        return opened
