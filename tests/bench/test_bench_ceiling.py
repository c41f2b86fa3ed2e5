"""bench.ceiling: the offline bounds of drafting on recorded greedy outputs."""

import random

import pytest

from specdec.bench.ceiling import CAP, Request, best_copy_rounds, bounds, interpolated, suffix_rounds
from specdec.draft_worker.suffix import SuffixProposer

CURVE = {1: 28.0, 2: 30.0, 4: 48.0, 8: 80.0}


def test_costs_are_interpolated_in_steps_and_extrapolated_along_the_last_segment():
    cost = interpolated(CURVE)
    assert cost(1) == 1.0
    assert cost(3) == 39.0 / 28.0
    assert cost(12) == (80.0 + 4 * 8.0) / 28.0
    with pytest.raises(ValueError, match="at least one more point"):
        interpolated({1: 28.0})


def test_the_best_copy_oracle_verifies_a_repeated_answer_in_rounds_of_the_cap():
    answer = list(range(100, 140))  # 40 tokens, none of them in the prompt
    rounds, spent = best_copy_rounds([1, 2, 3], answer, [answer], interpolated(CURVE))
    # 16 copied + 1, twice, then the last 5 + 1: the final token is always the target's own.
    assert CAP == 16 and rounds == 3
    fresh_rounds, _ = best_copy_rounds([1, 2, 3], answer, [], interpolated(CURVE))
    assert fresh_rounds == len(answer)  # nothing to copy: one token a round


def test_no_copying_proposer_needs_fewer_rounds_than_the_best_copy_oracle():
    rng = random.Random(7)
    cost = interpolated(CURVE)
    for _ in range(20):
        source = [rng.randrange(30) for _ in range(120)]
        # An answer that copies runs of the prompt, with fresh tokens between them.
        output = []
        while len(output) < 100:
            start = rng.randrange(len(source) - 10)
            output += source[start : start + rng.randrange(1, 10)] + [rng.randrange(30, 40)]
        oracle, _ = best_copy_rounds(source, output, [], cost)
        for exact in (True, False):
            rounds, _ = suffix_rounds(SuffixProposer(global_tokens=0), source, output, cost, exact)
            assert oracle <= rounds


def test_bounds_rank_the_oracle_first_and_add_prefill_end_to_end():
    rng = random.Random(3)
    code = [rng.randrange(50) for _ in range(80)]
    # One request (the figures are medians over requests): an answer that repeats its prompt with one change.
    requests = [Request(code, code[:40] + [77] + code[40:], 0.25)]
    table = bounds(requests, interpolated(CURVE))
    oracle, exact = table["best copy (oracle)"], table["suffix, exact trim"]
    assert oracle["tokens_per_round"] >= exact["tokens_per_round"] > 1.0
    # End to end, a quarter of each request's time is prefill, which no draft shortens.
    assert oracle["end_to_end"] == pytest.approx(1 / (0.25 + 0.75 / oracle["decode_speedup"]))


def test_the_oracle_copies_runs_that_span_the_prompt_and_the_answer():
    prompt, output = [5, 6, 7], [8, 9, 5, 6, 7, 8, 9, 1]
    # 8 and 9 are new (a round each); then the text so far is 5 6 7 8 9, copied whole across the prompt's end, and
    # the target adds the 1. Searching the prompt and the answer apart would copy 5 6 7 and need a fourth round.
    rounds, _ = best_copy_rounds(prompt, output, [], interpolated(CURVE))
    assert rounds == 3
