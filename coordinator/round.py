"""One speculation round (docs/design/round.md): draft, verify in one target pass, and keep the draft in step.

speculation_round is the whole round; it does no tracing, metrics or gamma policy (the request loop in
coordinator.request_run feeds its RoundResult to those), and no failure handling (the RoundWorkers it is given turn a
failing draft into "no proposal" and reopen a failed target session).
"""

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Protocol

from opentelemetry.context import Context

from specdec.common.rounds import DraftSource, Proposal, Verdict, WorkerTiming
from specdec.common.timing import elapsed_us
from specdec.coordinator.types import RoundStats, TimeSplit


class RoundWorkers(Protocol):
    async def propose(
        self, num_accepted: int, committed: list[int], g: int, parent: Context | None, assume_accepted: bool = False
    ) -> Proposal | None:
        """The draft's proposal of g tokens after applying the sync, or None when the draft failed."""

    async def verify(self, proposal: Proposal | None, parent: Context | None, decode_ahead: bool = False) -> Verdict:
        """The target's verdict on the proposal (None: the target decodes one token alone); decode_ahead: the
        target then scores the verdict's next token at once, for a next round expected not to draft."""

    @property
    def has_draft(self) -> bool:
        """The draft is still in use (it has not failed during this request)."""


# phase(name, gamma, overlapped) -> a context manager whose value is the trace context of the phase's worker calls.
Phase = Callable[[str, int, bool], AbstractContextManager[Context | None]]


def untraced(name: str, gamma: int = 0, overlapped: bool = False) -> AbstractContextManager[Context | None]:
    return nullcontext(None)


class DraftSync:
    """What the draft worker has not heard of yet, sent with the next draft step (see DraftStep).

    confirmed: tokens of the draft's chain (its proposals and assumed tokens since the last sync) the target has
    committed; committed: tokens committed after them that the chain does not hold. Overlap hits extend the chain
    without a sync; any other verdict needs one.
    """

    def __init__(self):
        self.confirmed = 0
        self.committed: list[int] = []

    def take(self) -> tuple[int, list[int]]:
        """(num_accepted, committed_token_ids) for the next step; nothing to apply while the chain is all valid."""
        if not self.committed:
            return 0, []
        sync = (self.confirmed, self.committed)
        self.confirmed, self.committed = 0, []
        return sync

    def confirm(self, tokens: int) -> None:
        self.confirmed += tokens

    def reject(self, accepted: int, next_token: int) -> None:
        """The target accepted `accepted` of the chain's outstanding tokens, then committed next_token."""
        self.confirmed += accepted
        self.committed = [next_token]

    def commit_unheard(self, tokens: list[int]) -> None:
        """A round the draft took no part in."""
        self.committed = self.committed + tokens


@dataclass
class RoundResult:
    gamma: int
    proposal: Proposal | None  # what was verified
    exposed: Proposal | None  # the proposal if it was drafted in this round, before verification
    verdict: Verdict
    committed: list[int]  # accepted drafts, then the target's next token
    pre: Proposal | None = None  # overlap: the next round's proposal, drafted during this verification
    ready: Proposal | None = None  # pre, when the verdict kept it valid: the next round's proposal
    draft_rtt_us: int = 0
    verify_rtt_us: int = 0
    pre_rtt_us: int = 0

    @property
    def drafted(self) -> int:
        return len(self.proposal.token_ids) if self.proposal else 0

    @property
    def overlapped(self) -> bool:
        return self.proposal is not None and self.exposed is None


async def speculation_round(
    workers: RoundWorkers,
    sync: DraftSync,
    gamma: int,
    ready: Proposal | None = None,
    next_gamma: Callable[[int], int] = lambda drafted: 0,
    phase: Phase = untraced,
    decode_ahead: bool = False,
    trim: Callable[[Proposal], int] = lambda proposal: len(proposal.token_ids),
) -> RoundResult:
    """One round: draft gamma tokens (or take `ready`, drafted during the previous round), verify them in one target
    pass, and record what the draft must hear of next round.

    next_gamma(drafted): overlap; tokens to pre-draft for the next round while the target verifies this one,
    assuming it accepts every drafted token (0: none).
    decode_ahead: the next round is not expected to draft; the target scores its first row at once (not with a
    pre-draft, whose proposal the next round would verify).
    trim(proposal): how many of the proposal's tokens to verify (the gamma policy's, for a draft that rates them);
    the draft hears of the rest as rejected.
    """
    t0 = time.perf_counter()
    gamma = len(ready.token_ids) if ready is not None else gamma
    proposal = ready if ready is not None else await drafted_now(workers, sync, gamma, phase)
    if proposal is not None:
        proposal = truncated(proposal, trim(proposal))
    exposed = proposal if ready is None else None  # drafted in this round, not behind the previous one
    t1 = time.perf_counter()
    drafted = proposal.token_ids if proposal else []
    g_next = next_gamma(len(drafted)) if workers.has_draft else 0
    pre_task = asyncio.ensure_future(pre_draft(workers, sync, g_next, phase)) if g_next > 0 else None
    try:
        with phase("verify", gamma, False) as parent:
            verdict = await workers.verify(proposal, parent, decode_ahead and pre_task is None)
    except BaseException:
        if pre_task is not None:
            pre_task.cancel()
        raise
    t2 = time.perf_counter()
    pre, pre_rtt_us = (await pre_task) if pre_task is not None else (None, 0)
    committed = drafted[: verdict.num_accepted] + [verdict.next_token]
    all_accepted = verdict.num_accepted == len(drafted)
    hit = pre is not None and all_accepted and pre.assumed_token == verdict.next_token and workers.has_draft
    tell_draft(sync, verdict, committed, hit, heard=proposal is not None or pre_task is not None)
    return RoundResult(
        gamma=gamma,
        proposal=proposal,
        exposed=exposed,
        verdict=verdict,
        committed=committed,
        pre=pre,
        ready=pre if hit and pre.token_ids else None,
        draft_rtt_us=elapsed_us(t0, t1),
        verify_rtt_us=elapsed_us(t1, t2),
        pre_rtt_us=pre_rtt_us,
    )


async def drafted_now(workers: RoundWorkers, sync: DraftSync, gamma: int, phase: Phase) -> Proposal | None:
    """The draft's gamma tokens for this round, proposed now (None for gamma 0)."""
    if gamma <= 0:
        return None
    with phase("draft", gamma, False) as parent:
        return await workers.propose(*sync.take(), gamma, parent)


def tell_draft(sync: DraftSync, verdict: Verdict, committed: list[int], hit: bool, heard: bool) -> None:
    """What the draft hears of the round: its pre-draft confirmed (a hit), its tokens rejected from the verdict's
    point on (it drafted), or the committed tokens to replay next time it drafts (it did not)."""
    if hit:
        sync.confirm(len(committed))
    elif heard:
        sync.reject(verdict.num_accepted, verdict.next_token)
    else:
        sync.commit_unheard(committed)


async def pre_draft(workers: RoundWorkers, sync: DraftSync, g: int, phase: Phase) -> tuple[Proposal | None, int]:
    """Drafts the next round behind this verification (see DraftStep.assume_accepted); the proposal (None on
    failure) and its round-trip time."""
    start = time.perf_counter()
    with phase("draft", g, True) as parent:
        proposal = await workers.propose(*sync.take(), g, parent, assume_accepted=True)
    return proposal, elapsed_us(start)


def round_stats(result: RoundResult, wall_us: int) -> RoundStats:
    """The round's stats record: counts, bytes, and its wall time split by where it went."""
    messages = [p for p in (result.exposed, result.pre) if p is not None] + [result.verdict]
    return RoundStats(
        gamma=result.gamma,
        drafted=result.drafted,
        accepted=result.verdict.num_accepted,
        committed=len(result.committed),
        time_split=round_split(result, wall_us),
        bytes_sent=sum(m.bytes_sent for m in messages),
        bytes_received=sum(m.bytes_received for m in messages),
        overlapped=result.overlapped,
        target_batch_size=result.verdict.timing.batch_size,
        draft_source=result.proposal.source if result.drafted else DraftSource.NONE,
    )


def handling(timing: WorkerTiming) -> tuple[int, int]:
    """(work, handling): what a worker reported doing for a message once it had it (not what it scored ahead of
    it), and its whole handling of it (in process, where nothing is measured around the work, the two are the
    same)."""
    work = timing.compute_us - timing.ahead_us + timing.sync_us + timing.queue_us
    return work, max(work, timing.handling_us)


def round_split(result: RoundResult, wall_us: int) -> TimeSplit:
    """A round's wall time by where it went: the workers' compute, sync, queueing and handling as they reported
    them; the rest of each round trip is transport, the rest of the round the coordinator's.

    The pre-draft (overlap) ran during verification: its work counts as hidden except for what ran past it. The
    target's scoring ahead ran before the round's step arrived (behind the previous verdict's and this step's
    transport): hidden too.
    """
    none = WorkerTiming()
    draft, verify = result.exposed.timing if result.exposed else none, result.verdict.timing
    pre = result.pre.timing if result.pre else none
    draft_work, draft_handling = handling(draft)
    verify_work, verify_handling = handling(verify)
    concurrent_us = max(result.verify_rtt_us, result.pre_rtt_us)
    past_verify_us = concurrent_us - result.verify_rtt_us
    pre_work = pre.compute_us + pre.sync_us
    pre_exposed = min(pre_work, past_verify_us)
    return TimeSplit(
        draft_us=draft.compute_us + pre_exposed,
        verify_us=verify.compute_us - verify.ahead_us,
        sync_us=draft.sync_us + verify.sync_us,
        queue_us=draft.queue_us + verify.queue_us,
        handling_us=(draft_handling - draft_work) + (verify_handling - verify_work),
        network_us=max(0, result.draft_rtt_us - draft_handling)
        + max(0, result.verify_rtt_us - verify_handling)
        + past_verify_us
        - pre_exposed,
        coordinator_us=max(0, wall_us - result.draft_rtt_us - concurrent_us),
        total_us=wall_us,
        draft_overlapped_us=pre_work - pre_exposed,
        verify_ahead_us=verify.ahead_us,
    )


def truncated(proposal: Proposal, room: int) -> Proposal:
    if len(proposal.token_ids) <= room:
        return proposal
    return replace(
        proposal,
        token_ids=proposal.token_ids[:room],
        distributions=proposal.distributions[:room],
        confidence=proposal.confidence[:room],
    )


def raise_if_cancelled() -> None:
    """asyncio.wait_for in Python 3.11 can swallow a cancellation that arrives as its awaitable completes (fixed in
    3.12): the request would then run on after its caller left. The task still counts the cancellation."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
