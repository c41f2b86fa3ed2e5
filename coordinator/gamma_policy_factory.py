"""Which gamma policy a request gets (fixed, heuristic, or the cost model over the measured speeds), built from the
deployment's state. GenerationEngine takes the factory as its policy_for: the seam where a test gives requests a
policy of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.coordinator.gamma_policy import CostModelPolicy, FixedPolicy, GammaPolicy, HeuristicPolicy
from specdec.coordinator.types import GenerationParams
from specdec.coordinator.workers import WorkerInfo

if TYPE_CHECKING:
    from specdec.coordinator.engine import GenerationEngine

DEFAULT_HEURISTIC_START = 4  # Hugging Face starts its heuristic schedule at num_assistant_tokens
SEEDED_AUTO_GAMMA = 4  # auto for seeded sampling, which must not depend on timings


def timings_choose_gamma(params: GenerationParams) -> bool:
    """Whether the cost model chooses the request's gamma from measured speeds: auto, except with the heuristic
    schedule, and except for seeded sampling. Gamma decides how the random streams are consumed, so a seeded
    request must not let timings choose it, or the same seed would give different text on another replica or after
    a restart."""
    sampling = params.sampling
    return params.num_speculative_tokens < 0 and params.gamma_schedule != "heuristic" and not sampling.seeded_sample


def defers_draft(draft: WorkerInfo | None, params: GenerationParams) -> bool:
    """Whether the draft session opens only once the gamma policy first wants to draft, in the background, the
    rounds running target-only until it is open: for a model draft (opening it prefills the prompt on the
    draft worker) whose use the cost model decides. Opened with the target's, a model that the cost model
    prices out (on a CPU, a draft costing half a target step) still cost every request its prefill: awaited
    before the first round, and on cores shared with the target beside the target's own work (measured on the
    Qwen 1.5B's editing loop with the 0.5B `#int8` as its draft: 1.0-1.4 s of the draft's prefill in each
    request's opening against 0.3-0.7 s for the target's, and 0.79x target-only over the workload with two
    tokens drafted in all). Not with overlap, whose pre-drafts begin with the first round."""
    return bool(draft and draft.forward_costs) and timings_choose_gamma(params) and not params.overlap


def gamma_policy_for(engine: GenerationEngine, params: GenerationParams, opening_overhead_ms: float | None = None) -> GammaPolicy:
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
        speed,
        acceptance=speed.request_acceptance(model_free=not (draft and draft.forward_costs)),
        # From what the deployment's rounds pay now, else the opening's transport. Not the opening's whole round
        # trip, as it was: under load that includes waiting behind other sessions' passes (hundreds of ms), which
        # made drafting look nearly free for a request's first rounds.
        overhead_ms=speed.round_overhead.value if speed.round_overhead.value is not None else opening_overhead_ms,
        peers=lambda: engine.running - 1,
    )


# (engine, params, opening_overhead_ms) -> the request's policy
PolicyFactory = Callable[["GenerationEngine", GenerationParams, "float | None"], GammaPolicy]
