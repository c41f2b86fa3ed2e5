"""A worker's cost curve: how long one forward pass takes for a given number of tokens, batch included.

Measured once when a worker loads its model and reported by GetInfo; the coordinator's choice of gamma starts
from it and rescales it by what the rounds actually take. On CPUs the curve is not monotonic (matrix kernels
change with the row count), so it is measured rather than modelled.
"""

import statistics
import time

import torch

from common.batched_forward import clone_cache, forward_sessions, session_cache

# Token counts measured: every count a single session's round can feed, then batches of several sessions.
CALIBRATION_TOKENS = [*range(1, 11), 12, 16, 24, 32, 48, 64]
CALIBRATION_CONTEXT = 160  # tokens already in each session's cache: a chat prompt and some of its answer
MAX_TOKENS_PER_SESSION = 8
MAX_PADDING = 4  # rows a pass may be padded by when more rows are cheaper (see cheapest_rows)


def nondecreasing(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The non-decreasing curve closest to `curve` in least squares (pool adjacent violators): neighbouring points
    that dip are replaced by their mean."""
    pools: list[list[float]] = []  # [sum, count] of each pool, left to right
    for _, cost in curve:
        pools.append([cost, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    costs = [total / count for total, count in pools for _ in range(count)]
    return [(tokens, cost) for (tokens, _), cost in zip(curve, costs, strict=True)]


def measure_forward_costs(
    model: torch.nn.Module, vocab_size: int, repeats: int = 2, fixed_kernels: bool = False
) -> list[tuple[int, float]]:
    """(tokens, median ms) for each count in CALIBRATION_TOKENS, with logits for every token as a verification
    needs them (the output layer is a large share of a small model's pass); batches of more than 8 tokens are
    split over sessions of at most 8, the way rounds of several sessions are batched. fixed_kernels
    (LoadedModel.fixed_kernels): only the first shape is warmed up, and since the cost cannot fall with more rows,
    a dip measured in a noisy moment is smoothed away (nondecreasing) instead of making every pass padded to the
    dip (cheapest_rows)."""
    layers = model.config.get_text_config().num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab_size, (CALIBRATION_CONTEXT,), generator=generator).tolist()
    caches = []
    costs = []
    for tokens in CALIBRATION_TOKENS:
        sizes = [MAX_TOKENS_PER_SESSION] * (tokens // MAX_TOKENS_PER_SESSION)
        if tokens % MAX_TOKENS_PER_SESSION:
            sizes.append(tokens % MAX_TOKENS_PER_SESSION)
        while len(caches) < len(sizes):
            # One prefill, then copies: prefilling 8 sessions of the context was most of a worker's start-up.
            if caches:
                caches.append(clone_cache(caches[0]))
            else:
                caches.append(session_cache(layers))
                forward_sessions(model, [caches[-1]], [context], [1])
        batch = caches[: len(sizes)]
        feeds = [context[:n] for n in sizes]
        samples = []
        warm_ups = 0 if fixed_kernels and costs else 1  # the first run of a shape warms up its kernels
        for _ in range(repeats + warm_ups):
            start = time.perf_counter()
            forward_sessions(model, batch, feeds, sizes)
            samples.append((time.perf_counter() - start) * 1e3)
            for cache, n in zip(batch, sizes, strict=True):
                cache.crop(-n)
        costs.append((tokens, statistics.median(samples[warm_ups:])))
    return nondecreasing(costs) if fixed_kernels else costs


def cost_at(curve: list[tuple[int, float]], tokens: int) -> float:
    """The curve's time for `tokens`: measured points exactly, linear between them, extrapolated past the last
    two (a batch that large is compute-bound: its time grows in proportion)."""
    if not curve:
        return 0.0
    for (t0, c0), (t1, c1) in zip(curve, curve[1:], strict=False):
        if tokens <= t1:
            if tokens <= t0 or t1 <= t0:
                return c0
            return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
    if len(curve) == 1 or curve[-1][0] <= curve[-2][0]:
        return curve[-1][1] * tokens / max(curve[-1][0], 1)
    (t0, c0), (t1, c1) = curve[-2], curve[-1]
    return c1 + max(0.0, (c1 - c0) / (t1 - t0)) * (tokens - t1)


def cheapest_rows(curve: list[tuple[int, float]], tokens: int) -> int:
    """The row count in [tokens, tokens + MAX_PADDING] whose pass is cheapest (the smallest on ties): on this
    project's CPU a pass over 4 rows costs less than over 2 or 3, so a 2-token verification is padded to 4."""
    if not curve:
        return tokens
    return min(range(tokens, tokens + MAX_PADDING + 1), key=lambda rows: (cost_at(curve, rows), rows))
