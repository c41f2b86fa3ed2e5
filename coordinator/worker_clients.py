"""Workers over gRPC: each session is one bidirectional stream (DraftService.Draft, TargetService.Verify)."""

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate
from opentelemetry.context import Context

from common.errors import InvalidArgument, ResourceExhausted, Unavailable, WorkerFailed
from common.protocol import distribution_from_proto, distribution_to_proto, sampling_to_proto
from common.rounds import Proposal, Verdict
from common.sampling import SamplingParams, SparseDistribution
from common.server import CHANNEL_OPTIONS
from common.tls import TlsFiles, channel_credentials
from coordinator.workers import WorkerInfo
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc, worker_pb2

INFO_FIELDS = [f.name for f in worker_pb2.GetInfoResponse.DESCRIPTOR.fields if f.name != "role"]


def info_from_proto(msg: worker_pb2.GetInfoResponse) -> WorkerInfo:
    fields = {name: getattr(msg, name) for name in INFO_FIELDS}
    fields["eos_token_ids"] = list(msg.eos_token_ids)
    fields["forward_costs"] = [(c.tokens, c.milliseconds) for c in msg.forward_costs]
    return WorkerInfo(**fields)


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
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{worker} worker: {details or code.name}")
    return WorkerFailed(f"{worker} worker failed: {code.name}: {details}")


def wire_form(dist: SparseDistribution | worker_pb2.SparseDistribution) -> worker_pb2.SparseDistribution:
    """q as the target receives it. A proposal that came over gRPC holds its q as received, so that it travels
    on without a round of conversions to tensors and back."""
    return dist if isinstance(dist, worker_pb2.SparseDistribution) else distribution_to_proto(dist)


class StreamSession:
    """One bidirectional stream used as request/response pairs."""

    worker = "worker"

    def __init__(self, call):
        self.call = call
        self.prefill_us = 0
        self.interrupted = False  # an exchange was cancelled between its write and its read

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

    async def open(
        self, prompt: list[int], params: SamplingParams, num_p_entries: int, parent: Context | None
    ) -> "GrpcTargetSession":
        start = target_pb2.VerifySessionStart(
            prompt_token_ids=prompt, sampling=sampling_to_proto(params), num_p_entries=num_p_entries
        )
        response, _, _ = await self.exchange(target_pb2.VerifyRequest(start=start), parent)
        self.prefill_us = response.started.timing.compute_us
        return self

    async def verify(
        self, draft_tokens: list[int], draft_dists: list[SparseDistribution], parent: Context | None = None
    ) -> Verdict:
        step = target_pb2.VerifyStep(draft_token_ids=draft_tokens, draft_distributions=[wire_form(d) for d in draft_dists])
        response, sent, received = await self.exchange(target_pb2.VerifyRequest(step=step), parent)
        result = response.result
        return Verdict(
            num_accepted=result.num_accepted,
            next_token=result.next_token_id,
            rollback=result.rollback,
            draft_token_probs=list(result.draft_token_probs),
            distributions=[distribution_from_proto(d) for d in result.distributions],
            compute_us=result.timing.compute_us,
            sync_us=result.timing.sync_us,
            bytes_sent=sent,
            bytes_received=received,
            batch_size=result.timing.batch_size,
            batch_tokens=result.timing.batch_tokens,
            queue_us=result.timing.queue_us,
            handling_us=result.timing.handling_us,
        )


class GrpcDraftSession(StreamSession):
    worker = "draft"

    async def open(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int, parent: Context | None
    ) -> "GrpcDraftSession":
        start = draft_pb2.DraftSessionStart(
            prompt_token_ids=prompt, sampling=sampling_to_proto(params), max_q_entries=max_q_entries
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
            compute_us=proposal.timing.compute_us,
            sync_us=proposal.timing.sync_us,
            bytes_sent=sent,
            bytes_received=received,
            assumed_token=proposal.assumed_token_id if proposal.HasField("assumed_token_id") else None,
            batch_size=proposal.timing.batch_size,
            queue_us=proposal.timing.queue_us,
            handling_us=proposal.timing.handling_us,
        )


def open_channel(address: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """A channel to a worker: mutual TLS when certificate files are given, plain otherwise."""
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class GrpcWorkers:
    """Channels to a target worker and, optionally, a draft worker."""

    def __init__(self, target_address: str, draft_address: str | None, tls: TlsFiles | None = None):
        self.target_channel = open_channel(target_address, tls)
        self.draft_channel = open_channel(draft_address, tls) if draft_address else None
        self.has_draft = draft_address is not None
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.target_channel)
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_channel) if self.draft_channel else None

    async def target_info(self) -> WorkerInfo:
        return await self.info(self.target_stub, "target")

    async def draft_info(self) -> WorkerInfo | None:
        return await self.info(self.draft_stub, "draft") if self.draft_stub else None

    async def info(self, stub, worker: str) -> WorkerInfo:
        try:
            return info_from_proto(await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10))
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error, worker) from None

    async def open_target(
        self, prompt: list[int], params: SamplingParams, num_p_entries: int, parent: Context | None = None
    ) -> GrpcTargetSession:
        # wait_for_ready: a target worker that is restarting is waited for (within the caller's timeout), not failed.
        session = GrpcTargetSession(self.target_stub.Verify(wait_for_ready=True))
        return await opened_or_closed(session, session.open(prompt, params, num_p_entries, parent))

    async def open_draft(
        self, prompt: list[int], params: SamplingParams, max_q_entries: int, parent: Context | None = None
    ) -> GrpcDraftSession:
        session = GrpcDraftSession(self.draft_stub.Draft())
        return await opened_or_closed(session, session.open(prompt, params, max_q_entries, parent))

    async def close(self) -> None:
        await self.target_channel.close()
        if self.draft_channel:
            await self.draft_channel.close()


async def opened_or_closed(session: StreamSession, opening):
    try:
        return await opening
    except BaseException:
        session.call.cancel()
        raise


async def wait_until_serving(address: str, timeout: float, tls: TlsFiles | None = None) -> None:
    """Polls the standard health service until the server reports SERVING (its model is loaded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise Unavailable(f"{address} did not report SERVING within {timeout:.0f} s")
            await asyncio.sleep(0.2)
