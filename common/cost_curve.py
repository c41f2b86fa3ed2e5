"""The maths of a worker's cost curve: how long one forward pass takes for a given number of tokens, batch included.

A worker measures its curve once when it loads its model (common.model_runner.ModelRunner.cost_curve) and reports
it by GetInfo; the coordinator's choice of gamma starts from it and rescales it by what the rounds actually take.
On CPUs the curve is not monotonic (matrix kernels change with the row count), so it is measured rather than
modelled.
"""

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
