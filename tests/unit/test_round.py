"""One speculation round (coordinator.round) against hand-built proposals and verdicts: what it commits, what the
draft hears next round, which pre-drafted proposal it keeps, and how its time is split."""

import asyncio

import pytest

from specdec.common.rounds import Proposal, Verdict, WorkerTiming
from specdec.coordinator.round import DraftSync, RoundResult, round_split, round_stats, speculation_round

DRAFTED = [11, 12, 13]


def proposal(tokens: list[int], assumed: int | None = None, **timing) -> Proposal:
    return Proposal(tokens, [None] * len(tokens), WorkerTiming(**timing), assumed_token=assumed)


class ScriptedWorkers:
    """Answers the round's calls from a script and records them."""

    def __init__(self, proposals: list[Proposal | None], verdict: Verdict):
        self.proposals = list(proposals)
        self.verdict = verdict
        self.proposed: list[tuple] = []
        self.verified: list[Proposal | None] = []
        self.decoding_ahead: list[bool] = []
        self.has_draft = True

    async def propose(self, num_accepted, committed, g, parent, assume_accepted=False):
        self.proposed.append((num_accepted, committed, g, assume_accepted))
        await asyncio.sleep(0)
        return self.proposals.pop(0)

    async def verify(self, proposal, parent, decode_ahead=False):
        self.verified.append(proposal)
        self.decoding_ahead.append(decode_ahead)
        await asyncio.sleep(0.001)  # long enough for a pre-draft to run beside it
        return self.verdict


def run_round(workers, sync, gamma, ready=None, next_gamma=lambda drafted: 0) -> RoundResult:
    return asyncio.run(speculation_round(workers, sync, gamma, ready, next_gamma))


def test_round_that_accepts_every_draft_commits_them_and_the_bonus_token():
    workers = ScriptedWorkers([proposal(DRAFTED)], Verdict(num_accepted=3, next_token=99, rollback=0, draft_token_probs=[]))
    sync = DraftSync()
    result = run_round(workers, sync, 3)
    assert result.committed == [*DRAFTED, 99]
    assert workers.proposed == [(0, [], 3, False)] and workers.verified[0].token_ids == DRAFTED
    assert result.drafted == 3 and not result.overlapped and result.ready is None
    assert sync.take() == (3, [99])  # the draft keeps all three and is told the bonus token


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_round_rejected_at_each_position_commits_the_accepted_prefix_and_the_correction(accepted):
    verdict = Verdict(num_accepted=accepted, next_token=77, rollback=3 - accepted, draft_token_probs=[])
    sync = DraftSync()
    result = run_round(ScriptedWorkers([proposal(DRAFTED)], verdict), sync, 3)
    assert result.committed == [*DRAFTED[:accepted], 77]
    assert round_stats(result, 1000).rollback == 3 - accepted
    assert sync.take() == (accepted, [77])  # the draft rolls back the rest and appends the correction


def test_round_sends_the_previous_rounds_sync_with_its_draft_step():
    sync = DraftSync()
    sync.reject(2, 55)
    workers = ScriptedWorkers([proposal([1])], Verdict(num_accepted=1, next_token=2, rollback=0, draft_token_probs=[]))
    run_round(workers, sync, 1)
    assert workers.proposed[0][:2] == (2, [55])


def test_round_without_drafting_tells_the_draft_its_tokens_later():
    workers = ScriptedWorkers([], Verdict(num_accepted=0, next_token=5, rollback=0, draft_token_probs=[]))
    sync = DraftSync()
    result = run_round(workers, sync, 0)
    assert result.committed == [5] and workers.proposed == [] and workers.verified == [None]
    result = run_round(ScriptedWorkers([], Verdict(0, 6, 0, [])), sync, 0)
    assert sync.take() == (0, [5, 6])


def test_failed_draft_leaves_the_target_to_decode_one_token():
    workers = ScriptedWorkers([None], Verdict(num_accepted=0, next_token=8, rollback=0, draft_token_probs=[]))
    result = run_round(workers, DraftSync(), 4)
    assert workers.verified == [None] and result.committed == [8] and result.drafted == 0


def test_overlap_keeps_the_pre_draft_when_the_target_accepts_all_and_its_bonus_was_assumed():
    pre = proposal([21, 22], assumed=99)
    workers = ScriptedWorkers([proposal(DRAFTED), pre], Verdict(3, 99, 0, []))
    sync = DraftSync()
    result = run_round(workers, sync, 3, next_gamma=lambda drafted: 2)
    assert workers.proposed[1] == (0, [], 2, True)  # pre-drafted behind verification, assuming all accepted
    assert result.ready is pre and result.committed == [*DRAFTED, 99]
    assert sync.take() == (0, [])  # the draft's chain is all valid: nothing to sync
    assert sync.confirmed == 4  # kept for the next sync: the three drafts and the assumed bonus token
    next_round = run_round(ScriptedWorkers([], Verdict(2, 23, 0, [])), sync, 0, ready=result.ready)
    assert next_round.overlapped and next_round.committed == [21, 22, 23] and next_round.gamma == 2


@pytest.mark.parametrize(("accepted", "next_token"), [(3, 98), (1, 99)])
def test_overlap_discards_the_pre_draft_when_the_verdict_breaks_its_assumption(accepted, next_token):
    pre = proposal([21, 22], assumed=99)
    workers = ScriptedWorkers([proposal(DRAFTED), pre], Verdict(accepted, next_token, 3 - accepted, []))
    sync = DraftSync()
    result = run_round(workers, sync, 3, next_gamma=lambda drafted: 2)
    assert result.pre is pre and result.ready is None
    assert sync.take() == (accepted, [next_token])  # the pre-draft is rolled back with the rejected tokens


def test_round_split_counts_the_workers_handling_apart_from_the_transport():
    exposed = proposal(DRAFTED, compute_us=300, sync_us=20, queue_us=10, handling_us=450)
    verdict = Verdict(3, 9, 0, [], timing=WorkerTiming(2000, 50, queue_us=100, handling_us=2300))
    result = RoundResult(3, exposed, exposed, verdict, [*DRAFTED, 9], draft_rtt_us=800, verify_rtt_us=2700)
    split = round_split(result, wall_us=3700)
    assert (split.draft_us, split.verify_us, split.sync_us, split.queue_us) == (300, 2000, 70, 110)
    assert split.handling_us == (450 - 330) + (2300 - 2150)
    assert split.network_us == (800 - 450) + (2700 - 2300)
    assert split.coordinator_us == 3700 - 800 - 2700
    parts = split.draft_us + split.verify_us + split.sync_us + split.queue_us + split.handling_us + split.network_us
    assert parts + split.coordinator_us == split.total_us
    assert split.overhead_us == split.network_us + split.coordinator_us + split.handling_us


def test_round_split_in_process_has_no_handling():
    verdict = Verdict(0, 9, 0, [], timing=WorkerTiming(1000))
    split = round_split(RoundResult(0, None, None, verdict, [9], verify_rtt_us=1000), wall_us=1100)
    assert split.handling_us == 0 and split.network_us == 0 and split.coordinator_us == 100


def test_a_round_verifies_the_part_of_the_proposal_its_trim_keeps_and_the_draft_hears_of_the_rest():
    drafted = Proposal([11, 12, 13, 14], [None] * 4, confidence=[0.9, 0.8, 0.1, 0.9])
    verdict = Verdict(num_accepted=2, next_token=99, rollback=0, draft_token_probs=[])
    workers, sync = ScriptedWorkers([drafted], verdict), DraftSync()
    result = asyncio.run(speculation_round(workers, sync, 4, trim=lambda proposal: 2))
    assert workers.verified[0].token_ids == [11, 12] and workers.verified[0].confidence == [0.9, 0.8]
    assert result.drafted == 2 and result.committed == [11, 12, 99]
    assert sync.take() == (2, [99])  # the draft keeps two of its four tokens, then the target's
