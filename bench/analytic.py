"""The analytic model of speculative decoding (Leviathan et al. 2023) and its correction by measured costs.

alpha: expected acceptance rate of a draft token; gamma: draft tokens per round; c: cost of one draft step over
one target step (T_draft / T_target). Short functions on floats, each computing one quantity.
"""

import statistics

from specdec.common.acceptance import expected_tokens


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al., Theorem 3.8: the walltime improvement, assuming verifying gamma+1 tokens costs one
    target step and that syncing and the network cost nothing."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def corrected_speedup(
    alpha: float,
    gamma: int,
    t_target: float,
    t_draft: float,
    t_verify: float,
    t_overhead: float,
    t_baseline_overhead: float = 0.0,
) -> float:
    """The same with measured costs: t_verify is the target's time for gamma+1 tokens (the cost curve, not one
    step), t_overhead the measured sync, network and coordinator time per round, and t_baseline_overhead the same
    overhead per token of the target-only baseline it is compared with."""
    baseline = t_target + t_baseline_overhead
    return expected_tokens(alpha, gamma) * baseline / (gamma * t_draft + t_verify + t_overhead)


def break_even_cost_ratio(alpha: float, gamma: int) -> float:
    """The largest c = T_draft / T_target at which speculation still breaks even (predicted speedup 1)."""
    return (expected_tokens(alpha, gamma) - 1) / gamma


def alpha_from_tokens_per_round(tokens_per_round: float, gamma: int, tolerance: float = 1e-9) -> float:
    """The alpha whose expected tokens per round is the measured one (bisection; the function grows with alpha)."""
    low, high = 0.0, 1.0
    target = min(max(tokens_per_round, 1.0), gamma + 1.0)
    while high - low > tolerance:
        mid = (low + high) / 2
        if expected_tokens(mid, gamma) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
