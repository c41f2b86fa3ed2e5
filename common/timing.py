"""The one timer of every stats record: microseconds between perf_counter readings."""

import time


def elapsed_us(start: float, end: float | None = None) -> int:
    """Whole microseconds from start to end (both time.perf_counter() readings; end: now when not given)."""
    return int(((time.perf_counter() if end is None else end) - start) * 1e6)
