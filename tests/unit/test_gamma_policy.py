"""Choosing gamma: the cost model against hand-computed cases, Hugging Face's heuristic, and the draft sync."""

import asyncio

import pytest

from specdec.common.cost_curve import cheapest_rows, cost_at, nondecreasing
from specdec.common.rounds import Proposal
from specdec.common.model_runner import CALIBRATION_TOKENS, TorchRunner
from specdec.common.sampling import SamplingParams
from specdec.coordinator.config import CoordinatorConfig
from specdec.coordinator.round import DraftSync
from specdec.coordinator.types import GenerationParams
from specdec.coordinator.gamma_policy_factory import gamma_policy_for
from specdec.coordinator.gamma_policy import AcceptanceEstimate, CostModelPolicy, HeuristicPolicy, MeasuredSpeed
from specdec.coordinator.in_process import InProcessWorkers
from specdec.coordinator.server import build_engine
from specdec.target_worker.engine import TargetEngine
from tests.support.services import draft_engine_for

# Measured on this machine: SmolLM2-135M on 2 CPU cores, ms per forward pass of 1..9 tokens and larger batches.
SMOLLM2_CPU = [(1, 39), (2, 59), (3, 73), (4, 55), (5, 50), (6, 53), (7, 64), (8, 53), (9, 60), (16, 72), (40, 102)]


def policy_with(acceptance: float, draft_costs=(), overhead_ms: float = 3.5, **kwargs) -> CostModelPolicy:
    policy = CostModelPolicy(SMOLLM2_CPU, list(draft_costs), max_gamma=8, overhead_ms=overhead_ms, **kwargs)
    policy.acceptance = AcceptanceEstimate(successes=1000 * acceptance, trials=1000)
    return policy


def test_a_verification_is_padded_to_the_cheapest_row_count():
    assert [cheapest_rows(SMOLLM2_CPU, n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 5, 5, 5, 5, 6, 8]
    assert cost_at(SMOLLM2_CPU, cheapest_rows(SMOLLM2_CPU, 3)) == 50
    assert cheapest_rows([], 3) == 3


def test_a_curve_that_cannot_fall_is_smoothed_instead_of_padded_for():
    # A gguf worker's curve measured in a noisy moment: the 2-row pass looked cheaper than the 1-row one.
    measured = [(1, 90.2), (2, 76.8), (3, 92.8), (4, 118.6), (5, 110.0), (6, 130.0)]
    smooth = nondecreasing(measured)
    assert [c for _, c in smooth] == pytest.approx([83.5, 83.5, 92.8, 114.3, 114.3, 130.0])
    assert [cheapest_rows(measured, 1), cheapest_rows(smooth, 1)] == [2, 1]  # the raw curve would pad every step
    assert all(cheapest_rows(smooth, n) == n for n in range(1, 7))
    assert nondecreasing(SMOLLM2_CPU[:1]) == SMOLLM2_CPU[:1] and nondecreasing([]) == []


def test_a_fixed_kernel_models_measured_curve_never_falls(target_model):
    runner = TorchRunner(target_model.model)
    runner.fixed_kernels = True  # as the gguf engine's runner
    curve = runner.cost_curve(target_model.vocab_size, repeats=1)
    assert [t for t, _ in curve] == CALIBRATION_TOKENS
    assert all(a <= b for (_, a), (_, b) in zip(curve, curve[1:], strict=False)) and curve[0][1] > 0


def test_cost_curve_interpolates_and_extrapolates():
    assert cost_at(SMOLLM2_CPU, 4) == 55
    assert cost_at(SMOLLM2_CPU, 12) == pytest.approx(60 + (72 - 60) * 3 / 7)
    assert cost_at(SMOLLM2_CPU, 64) == pytest.approx(102 + (102 - 72) / 24 * 24)
    assert cost_at([], 5) == 0.0


def test_a_draft_that_keeps_missing_is_not_asked():
    assert policy_with(0.05).choose(100) == 0


def test_an_accurate_free_draft_gets_long_rounds_at_a_cheap_row_count():
    # Verifying 8 tokens costs less than verifying 3 on this CPU: the model takes the measured curve, not a line.
    assert policy_with(0.9).choose(100) == 7


def test_the_measured_curve_skips_the_expensive_two_and_three_token_verifies():
    policy = policy_with(0.45)
    assert policy.choose(100) == 4
    assert policy.rate(4) > policy.rate(2) and policy.rate(4) > policy.rate(3)


def test_a_model_draft_priced_out_by_its_start_up_curve_drafts_one_token_once_to_measure_its_speed():
    """A draft calibrated beside another worker's load looked twice as slow as it runs and was never asked, so never
    measured: until a round has measured it, a round the cost model would not draft drafts one token."""
    speed = MeasuredSpeed()
    slow_curve = [(1, 30.0)]
    first = policy_with(0.6, slow_curve, speed=speed)
    assert first.rate(1) < first.rate(0) and first.choose(100) == 1
    first.observe_draft(1, 8_000)  # it runs at 8 ms a token
    assert first.choose(100) > 1 and policy_with(0.6, slow_curve, speed=speed).choose(100) > 1
    confirmed = policy_with(0.6, slow_curve)
    confirmed.observe_draft(1, 30_000)  # as slow as its curve: it is not asked again
    assert confirmed.choose(100) == 0 and confirmed.choose(0) == 0


def test_a_costly_model_draft_pays_only_when_hidden_behind_verification():
    policy = policy_with(0.4, draft_costs=[(1, 11.0)])
    policy.observe_draft(1, 11_000)  # as fast as its curve says
    assert policy.choose(100) == 0
    # Behind a 5-token verification (50 ms) the draft has time for 4 passes: the bonus guess and 3 tokens.
    assert policy.choose(100, hidden_behind=5) == 3


def test_a_saturated_target_makes_speculation_shorter():
    """Alone, 4 drafts at acceptance 0.45 are best; in a batch of 8 sessions they would make the batch cost 102 ms
    instead of 53: the batch's throughput is highest with 2."""
    alone, loaded = policy_with(0.45), policy_with(0.45)
    loaded.observe(drafted=0, accepted=0, verified_tokens=1, verify_us=53_000, batch_size=8, batch_tokens=8)
    assert loaded.other_sessions == 7
    assert alone.choose(100) == 4 and loaded.choose(100) == 2
    assert policy_with(0.1, other_sessions=7).choose(100) == 0


def test_a_slower_target_than_calibrated_rescales_the_curve():
    policy = policy_with(0.5)
    for _ in range(30):
        policy.observe(drafted=4, accepted=2, verified_tokens=5, verify_us=100_000, batch_size=1, batch_tokens=5)
    assert policy.target_scale.value == pytest.approx(2.0, rel=0.01)


def test_acceptance_estimate_follows_recent_rounds_and_returns_to_the_prior_when_unused():
    estimate = AcceptanceEstimate()
    for _ in range(20):
        estimate.observe(drafted=4, accepted=0)
    assert estimate.value < 0.1
    for _ in range(20):
        estimate.observe(drafted=0, accepted=0)
    assert estimate.value < 0.15, "a few rounds without drafting must not make a bad draft look good again"
    for _ in range(200):
        estimate.observe(drafted=0, accepted=0)
    assert estimate.value > 0.45


def test_a_model_free_draft_is_tried_on_every_request_whatever_earlier_requests_accepted():
    """Prompt lookup's acceptance belongs to each request's text: after many requests whose proposals all failed
    (code), a new request (perhaps one that copies its input) still drafts at first, and stops once its own rounds
    miss. A model draft's new request starts from the deployment's rate and does not draft."""
    speed = MeasuredSpeed()
    for _ in range(400):  # earlier requests' rounds: every proposal rejected
        speed.acceptance.observe(drafted=4, accepted=0)
    assert speed.prior(model_free=False) < 0.05
    model = policy_with(0.0, draft_costs=[(1, 2.0)])
    model.acceptance = AcceptanceEstimate(prior=speed.prior(model_free=False))
    assert model.choose(100) == 0
    free = policy_with(0.0)
    free.acceptance = AcceptanceEstimate(prior=speed.prior(model_free=True))
    assert free.choose(100) > 0
    for _ in range(3):  # this request's own proposals miss too
        free.observe(drafted=4, accepted=0, verified_tokens=5, verify_us=55_000, batch_size=1, batch_tokens=5)
    assert free.choose(100) == 0


# The Qwen pair on the gguf engine, 2 AVX2 cores (docs/results/): the 1.5B target's ms per pass of 1..8 tokens
# and the 0.5B draft's per token, a draft half as costly as a target step.
QWEN_TARGET_AVX2 = [(1, 106.1), (2, 128.7), (3, 124.4), (4, 145.1), (5, 183.0), (8, 222.9)]
QWEN_DRAFT_AVX2 = [(1, 51.5)]


def qwen_request(speed: MeasuredSpeed, feeds_it: bool = False) -> CostModelPolicy:
    """A request starting from the deployment's acceptance; feeds_it: one whose rounds the deployment measures (a
    request of its own measures nothing for the others)."""
    return CostModelPolicy(
        QWEN_TARGET_AVX2,
        QWEN_DRAFT_AVX2,
        max_gamma=8,
        speed=speed if feeds_it else MeasuredSpeed(),
        overhead_ms=3.0,
        acceptance=speed.request_acceptance(model_free=False),
    )


def test_a_model_draft_is_tried_before_anything_is_measured():
    """At the neutral prior of 0.5 a draft at half a target step never pays, so the first request never drafted
    and the deployment never learned that the pair agrees on most tokens: its first request must draft."""
    assert qwen_request(MeasuredSpeed()).choose(100) > 0
    pessimistic = qwen_request(MeasuredSpeed())
    pessimistic.acceptance = AcceptanceEstimate(prior=0.5)
    pessimistic.observe_draft(1, 51_500)  # measured as fast as its curve
    assert pessimistic.choose(100) == 0


def test_one_early_rejection_does_not_stop_a_model_draft():
    speed = MeasuredSpeed()
    request = qwen_request(speed)
    gamma = request.choose(100)
    request.observe(drafted=gamma, accepted=0, verified_tokens=gamma + 1, verify_us=124_000, batch_size=1, batch_tokens=3)
    assert request.choose(100) > 0
    for _ in range(6):  # but a draft that keeps missing is stopped within a few rounds
        gamma = request.choose(100)
        request.observe_draft(gamma, gamma * 51_500)
        request.observe(drafted=gamma, accepted=0, verified_tokens=gamma + 1, verify_us=124_000, batch_size=1, batch_tokens=3)
    assert request.choose(100) == 0


def test_a_deployment_whose_model_draft_stopped_drafting_tries_again_later():
    """Requests that do not draft still move the deployment's rate back towards its prior, so that a bad stretch of
    text (a model draft missing on every round) does not turn drafting off for good."""
    speed = MeasuredSpeed()
    request = qwen_request(speed, feeds_it=True)
    for _ in range(100):
        request.observe(drafted=2, accepted=0, verified_tokens=3, verify_us=124_000, batch_size=1, batch_tokens=3)
    assert qwen_request(speed).choose(100) == 0
    for _ in range(2000):  # 200 s of one client's rounds
        request.observe(drafted=0, accepted=0, verified_tokens=1, verify_us=106_000, batch_size=1, batch_tokens=1)
    assert qwen_request(speed).choose(100) > 0


def test_a_model_free_request_starts_from_the_neutral_prior_not_a_model_drafts_guess():
    """The deployment's rate starts at a model draft's optimistic guess and drifts back to it when nobody drafts;
    a model-free draft's request reads the same evidence from the neutral prior instead."""
    speed = MeasuredSpeed()
    assert speed.prior(model_free=True) == pytest.approx(0.5)
    speed.acceptance.observe(drafted=4, accepted=1)
    for _ in range(3000):
        speed.acceptance.observe(drafted=0, accepted=0)
    assert speed.prior(model_free=False) == pytest.approx(0.8, abs=1e-3)
    assert speed.prior(model_free=True) == pytest.approx(0.5, abs=1e-3)


def test_heuristic_schedule_adds_two_after_a_full_acceptance_and_drops_one_otherwise():
    policy = HeuristicPolicy(gamma=4, max_gamma=16)
    policy.observe(drafted=4, accepted=4, verified_tokens=5, verify_us=0, batch_size=1, batch_tokens=5)
    assert policy.choose(100) == 6
    policy.observe(drafted=6, accepted=2, verified_tokens=7, verify_us=0, batch_size=1, batch_tokens=7)
    assert policy.choose(100) == 5 and policy.choose(3) == 3
    for _ in range(10):
        policy.observe(drafted=1, accepted=0, verified_tokens=2, verify_us=0, batch_size=1, batch_tokens=2)
    assert policy.choose(100) == 1


def test_draft_sync_keeps_the_chain_across_overlap_hits_and_crops_after_a_miss():
    sync = DraftSync()
    assert sync.take() == (0, [])
    sync.reject(accepted=2, next_token=7)  # round 1: 2 of 4 accepted, the target said 7
    assert sync.take() == (2, [7])
    sync.confirm(4)  # round 2: all 3 accepted and the assumed bonus was right: the chain is kept, no sync
    assert sync.take() == (0, [])
    sync.reject(accepted=1, next_token=9)  # round 3 (the overlapped proposal): 1 accepted
    assert sync.take() == (5, [9])
    sync.commit_unheard([3])  # a round without the draft
    sync.commit_unheard([4])
    assert sync.take() == (0, [3, 4])


def test_a_verification_slower_than_calibrated_stops_paying_once_measured():
    """The curve says 5 rows cost 50 ms; if they take 80 in practice, a draft accepted 25 % of the time stops."""
    policy = policy_with(0.25)
    assert policy.choose(100) == 4
    for _ in range(10):
        policy.observe(drafted=4, accepted=1, verified_tokens=5, verify_us=80_000, batch_size=1, batch_tokens=5)
        policy.observe(drafted=0, accepted=0, verified_tokens=1, verify_us=39_000, batch_size=1, batch_tokens=1)
    policy.acceptance = AcceptanceEstimate(successes=250, trials=1000)
    assert policy.choose(100) == 0


def test_policies_of_one_coordinator_share_the_worker_speed_they_measure():
    speed = MeasuredSpeed()
    first, second = (policy_with(0.6, [(1, 10)], speed=speed) for _ in range(2))
    for _ in range(20):  # the first request's draft runs 4x slower than its start-up curve said
        first.observe_draft(2, 80_000)
    assert second.draft_ms(1) == pytest.approx(40, rel=0.05)
    assert policy_with(0.6, [(1, 10)]).draft_ms(1) == 10  # a policy of its own starts from the curve


def test_the_sessions_of_one_pass_move_the_shared_scales_as_one_measurement():
    """Every session of a batch reports the same pass. Counted once each, 8 sessions left the coordinator's shared
    scales at the last pass's time (0.8^8 of the memory kept), and the choice between row counts swung with it."""
    speed, alone = MeasuredSpeed(), MeasuredSpeed()
    batch = [policy_with(0.5, speed=speed) for _ in range(8)]
    for policy in batch:  # one pass of 8 sessions, 8 rows, measured 2x the curve (53 ms)
        policy.observe(drafted=0, accepted=0, verified_tokens=1, verify_us=106_000, batch_size=8, batch_tokens=8)
    single = policy_with(0.5, speed=alone)
    single.observe(drafted=0, accepted=0, verified_tokens=8, verify_us=106_000, batch_size=1, batch_tokens=8)
    assert speed.target_scale.value == pytest.approx(alone.target_scale.value) == pytest.approx(1.2)
    assert speed.row_scales[8].value == pytest.approx(1.22, abs=0.01)  # counted 8 times it would be 1.87


def test_a_new_request_starts_from_the_round_overhead_the_deployment_measured(target_model):
    """Not from its opening's round trip, which under load includes waiting behind other sessions' passes (hundreds
    of ms, which made drafting look nearly free for a request's first rounds); the opening's transport is the first
    guess only while the deployment has measured nothing."""

    async def run():
        workers = InProcessWorkers(TargetEngine(target_model, calibrate=True), draft_engine_for(None, "ngram"))
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
        params = GenerationParams(list(range(40, 60)), SamplingParams(temperature=0), 8, -1)
        assert gamma_policy_for(engine, params).overhead_ms is None
        assert gamma_policy_for(engine, params, opening_overhead_ms=2.5).overhead_ms == 2.5  # nothing measured yet
        await engine.generate_all(params)
        measured = engine.measured_speed.round_overhead.value
        assert measured is not None and measured < 50
        policy = gamma_policy_for(engine, params, opening_overhead_ms=2.5)
        assert policy.overhead_ms == measured and policy.shared_overhead is engine.measured_speed.round_overhead

    asyncio.run(run())


def test_a_request_leaves_what_its_rounds_measured_for_the_next(target_model, draft_models):
    async def run():
        workers = InProcessWorkers(TargetEngine(target_model, calibrate=True), draft_engine_for(draft_models, 0.1))
        engine = await build_engine(workers, CoordinatorConfig(), tokenizer=target_model.tokenizer)
        assert engine.measured_speed.target_scale.value == 1.0
        await engine.generate_all(GenerationParams(list(range(40, 60)), SamplingParams(temperature=0), 16, -1))
        assert engine.measured_speed.target_scale.value != 1.0 and engine.measured_speed.row_scales

    asyncio.run(run())


def rated(confidence: list[float], bytes_sent: int = 0) -> Proposal:
    """A model-free proposal of len(confidence) tokens rated so (bytes_sent 0: drafted in this process)."""
    tokens = list(range(100, 100 + len(confidence)))
    return Proposal(tokens, [None] * len(tokens), bytes_sent=bytes_sent, confidence=list(confidence))


def test_a_rated_proposal_is_verified_as_far_as_its_calibrated_confidence_pays():
    policy = policy_with(0.5)
    # A pass over 8 rows costs less than one over 3 on this curve: a proposal all but certain is verified whole.
    assert policy.trim(rated([0.99] * 7)) == 7
    # A token the proposer doubts ends what is worth verifying, whatever follows it.
    assert policy.trim(rated([0.99, 0.99, 0.99, 0.99, 0.01, 0.99, 0.99, 0.99])) == 4
    assert policy.trim(rated([0.02] * 8)) == 0  # a guess: the round is a target step
    # Without ratings the proposal is what choose asked for.
    assert policy.trim(Proposal([1, 2, 3], [None] * 3)) == 3


def test_rated_tokens_that_the_target_keeps_rejecting_stop_being_verified():
    policy = policy_with(0.5)
    assert policy.trim(rated([0.95] * 7)) == 7
    for _ in range(40):
        policy.observe_confidence([0.95] * 8, 0)
    assert policy.trim(rated([0.95] * 8)) == 0
    # Learned for the deployment: the next request's policy starts from it.
    speed = MeasuredSpeed()
    first = policy_with(0.5, speed=speed)
    for _ in range(40):
        first.observe_confidence([0.95] * 8, 0)
    assert policy_with(0.5, speed=speed).trim(rated([0.95] * 8)) == 0


def test_a_model_free_draft_that_rates_its_tokens_is_asked_for_all_it_may_propose_where_asking_is_free():
    policy = policy_with(0.05)  # by its acceptance alone, not worth asking
    assert policy.ask(100) == policy.choose(100) == 0
    policy.trim(rated([0.9] * 3))  # rated, in this process
    assert policy.ask(100) == 8 and policy.ask(5) == 5
    policy.trim(Proposal([], []))  # no match this round: shows nothing of the draft
    assert policy.ask(100) == 8
    # Rated, from a draft worker: asking costs an exchange, priced by the acceptance rate, and what choose asked
    # for is verified whole, so that the rate keeps learning.
    assert policy.trim(rated([0.02] * 3, bytes_sent=120)) == 3
    assert policy.ask(100) == 0
    assert policy_with(0.9).ask(100) == 7  # unrated: as choose
    model = policy_with(0.05, draft_costs=[(1, 20.0)])
    model.trim(rated([0.9] * 3))  # a hybrid's suffix proposal: its model's tokens still cost a pass each
    assert model.ask(100) == model.choose(100)
