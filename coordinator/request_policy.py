"""How a request chooses each round's gamma: which policy (fixed, heuristic, or the cost model over the measured
speeds) a request gets, built from the deployment's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator.gamma_policy import CostModelPolicy, FixedPolicy, HeuristicPolicy
from coordinator.types import GenerationParams

if TYPE_CHECKING:
    from coordinator.engine import GenerationEngine

DEFAULT_HEURISTIC_START = 4  # Hugging Face starts its heuristic schedule at num_assistant_tokens
SEEDED_AUTO_GAMMA = 4  # auto for seeded sampling, which must not depend on timings


def timings_choose_gamma(params: GenerationParams) -> bool:
    """Whether the cost model chooses the request's gamma from measured speeds: auto, except with the heuristic
    schedule, and except for seeded sampling. Gamma decides how the random streams are consumed, so a seeded
    request must not let timings choose it, or the same seed would give different text on another replica or after
    a restart."""
    sampling = params.sampling
    seeded = sampling.seed is not None and not sampling.greedy
    return params.num_speculative_tokens < 0 and params.gamma_schedule != "heuristic" and not seeded


def gamma_policy_for(engine: GenerationEngine, params: GenerationParams, opening_overhead_ms: float | None = None):
    """How a request chooses each round's gamma: the fixed gamma it asked for, the heuristic schedule, or (auto)
    the cost model over the workers' measured speeds. opening_overhead_ms: the target opening's transport, the
    round overhead's first guess where the deployment has measured none yet."""
    gamma, config = params.num_speculative_tokens, engine.config
    if gamma >= 0:
        return FixedPolicy(gamma)
    if params.gamma_schedule == "heuristic":
        return HeuristicPolicy(DEFAULT_HEURISTIC_START, config.max_num_speculative_tokens)
    if not timings_choose_gamma(params):
        return FixedPolicy(SEEDED_AUTO_GAMMA)
    draft, speed = engine.draft, engine.measured_speed
    return CostModelPolicy(
        engine.target.forward_costs,
        draft.forward_costs if draft else [],
        config.max_num_speculative_tokens,
        acceptance=speed.request_acceptance(model_free=not (draft and draft.forward_costs)),
        target_scale=speed.target_scale,
        row_scales=speed.row_scales,
        draft_scale=speed.draft_scale,
        shared_acceptance=speed.acceptance,
        draft_exchange=speed.draft_exchange,
        # From what the deployment's rounds pay now, else the opening's transport. Not the opening's whole round
        # trip, as it was: under load that includes waiting behind other sessions' passes (hundreds of ms), which
        # made drafting look nearly free for a request's first rounds.
        overhead_ms=speed.round_overhead.value if speed.round_overhead.value is not None else opening_overhead_ms,
        shared_overhead=speed.round_overhead,
        peers=lambda: engine.running - 1,
        calibration=speed.calibration,
        draft_traits=speed.draft_traits,
    )
