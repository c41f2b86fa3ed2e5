"""`python -m specdec.bench.ceiling RESULTS.json`: how far a workload's greedy outputs could be drafted, worked out offline.

A greedy output is deterministic, so the fate of any proposal is known without the target: replaying a run's
target-only outputs through a proposer shows what drafting could reach there, free of this machine's noise. Per
workload, as tokens per round and as the decode speedup that the target's cost curve gives (a round costs the pass
over its tokens, plus the overhead beyond the pass, as a fraction of a step):

- best copy: an oracle that at each position copies the longest run of the output that occurs anywhere earlier (the
  prompt and the output so far, the earlier requests' outputs), found in hindsight, and verifies exactly that run.
  No proposer that copies text needs fewer rounds (what a round can copy never shrinks as the answer goes on, so the
  longest copy each round is optimal); its cost is an estimate, not a bound, since a shorter round can cost less.
- suffix, exact trim: the suffix proposer's proposals (the request's tree and the global one, as the coordinator
  runs them), each verified exactly as far as it will be accepted: the proposer's choices, with a perfect trim.
- suffix, rated trim: verified as far as its (uncalibrated) confidences say pays, as `CostModelPolicy.trim` does.

End to end, each decode speedup is combined with the share of the target-only requests' time spent in prefill, which
no draft shortens. Input: a drafting suite's or llama-cpp suite's results.json (the target-only runs, in the order
they ran, each prompt's first run only: a repeat's global tree would hold its own answer).
"""

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.drafting import editing_requests, grounded_requests
from specdec.bench.runner import load_prompts
from specdec.common.sampling import SamplingParams
from specdec.draft_worker.suffix import SuffixProposer
from specdec.draft_worker.suffix_tree import Speculation

CAP = 16  # most tokens a round may verify beyond its own (the coordinator's max_num_speculative_tokens)
OVERHEAD = 0.1  # a round's cost beyond its pass, in steps (about 3 ms of a 28-30 ms 1.5B step, docs/results/)


@dataclass
class Request:
    prompt: list[int]
    output: list[int]
    prefill_share: float  # of its target-only time


def interpolated(costs: dict[int, float]) -> Callable[[int], float]:
    """A pass's cost over `rows` tokens, in steps (the 1-token pass is 1): linear between measured points, and on
    along the last segment's slope beyond them."""
    points = sorted(costs.items())
    if 1 not in costs or len(points) < 2:
        raise ValueError(f"a cost curve needs the 1-token pass and at least one more point, got {sorted(costs)}")
    step = costs[1]

    def cost(rows: int) -> float:
        for (a, ca), (b, cb) in zip(points, points[1:], strict=False):
            if a <= rows <= b:
                return (ca + (cb - ca) * (rows - a) / (b - a)) / step
        (a, ca), (b, cb) = points[-2], points[-1]
        return (cb + (cb - ca) * (rows - b) / (b - a)) / step

    return cost


def longest_copy(texts: Sequence[Sequence[int]], wanted: Sequence[int]) -> int:
    """The length of the longest prefix of `wanted` that occurs in one of the texts."""
    best = 0
    for text in texts:
        first = wanted[0]
        for start, token in enumerate(text):
            if token != first:
                continue
            n = 1
            while n < len(wanted) and start + n < len(text) and text[start + n] == wanted[n]:
                n += 1
            best = max(best, n)
            if best == len(wanted):
                return best
    return best


def best_copy_rounds(prompt: list[int], output: list[int], history: list[list[int]], cost: Callable[[int], float]):
    """(rounds, cost in steps) of the best-copy oracle over one output."""
    rounds, spent, i = 0, 0.0, 0
    while i < len(output):
        # The prompt and the answer so far as one text, as the request's suffix tree holds them (a run may span both).
        copied = min(longest_copy([*history, prompt + output[:i]], output[i : i + CAP]), len(output) - i - 1)
        i, rounds, spent = i + copied + 1, rounds + 1, spent + cost(copied + 1) + OVERHEAD
    return rounds, spent


def rated_prefix(speculation: Speculation, cost: Callable[[int], float]) -> int:
    """How many of the proposal's tokens have the most expected tokens per step (0: none beats a bare step)."""
    best, best_rate, reach, expected = 0, 1 / (1 + OVERHEAD), 1.0, 1.0
    for n, confidence in enumerate(speculation.confidence, 1):
        reach *= confidence
        expected += reach
        rate = expected / (cost(n + 1) + OVERHEAD)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def suffix_rounds(proposer: SuffixProposer, prompt: list[int], output: list[int], cost, exact: bool):
    """(rounds, cost in steps) of the suffix proposer over one output; its global tree then holds the output."""
    state = proposer.open(prompt, SamplingParams(temperature=0), 0, len(prompt) + len(output))
    rounds, spent, i = 0, 0.0, 0
    while i < len(output):
        speculation, _ = proposer.speculate(state, min(CAP, len(output) - i - 1))
        proposed = speculation.token_ids
        accepted = 0
        while accepted < len(proposed) and proposed[accepted] == output[i + accepted]:
            accepted += 1
        verified = accepted if exact else rated_prefix(speculation, cost)
        accepted = min(accepted, verified)
        state.chain = proposed[:verified]
        proposer.observe(state, accepted, output[i + accepted : i + accepted + 1])
        i, rounds, spent = i + accepted + 1, rounds + 1, spent + cost(verified + 1) + OVERHEAD
    proposer.close(state)
    return rounds, spent


def bounds(requests: list[Request], cost: Callable[[int], float]) -> dict[str, dict]:
    """Per method: tokens per round, the median decode speedup per request, and its end-to-end bound."""
    methods = {
        "best copy (oracle)": None,
        "suffix, exact trim": SuffixProposer(),
        "suffix, rated trim": SuffixProposer(),
    }
    out = {}
    for name, proposer in methods.items():
        history, tokens, rounds, speedups, end_to_end = [], 0, 0, [], []
        for request in requests:
            if proposer is None:
                n, spent = best_copy_rounds(request.prompt, request.output, history, cost)
            else:
                n, spent = suffix_rounds(proposer, request.prompt, request.output, cost, exact=name.endswith("exact trim"))
            history.append(request.output)
            decode = len(request.output) * (1 + OVERHEAD) / spent
            tokens, rounds = tokens + len(request.output), rounds + n
            speedups.append(decode)
            end_to_end.append(1 / (request.prefill_share + (1 - request.prefill_share) / decode))
        out[name] = {
            "tokens_per_round": tokens / rounds,
            "decode_speedup": statistics.median(speedups),
            "end_to_end": statistics.median(end_to_end),
        }
    return out


def requests_of(results: dict, tokenizer) -> dict[str, list[Request]]:
    """The target-only runs of a drafting or llama-cpp suite's results, by workload, in the order they ran."""
    prompts = {p["id"]: p["prompt"] for p in load_prompts(None)}
    prompts |= {r["id"]: r["prompt"] for task in editing_requests(False) + grounded_requests(False) for r in task}
    if "runs" in results:  # drafting suite
        runs = [(r.get("workload", r["category"]), r) for r in results["runs"] if r["system"] == "target-only"]
    else:  # llama-cpp suite
        runs = [(r["category"], r) for r in results["rows"] if r["system"] == "specdec target-only"]
    out: dict[str, list[Request]] = {}
    seen = set()
    for workload, run in runs:
        if run["prompt_id"] in seen:  # a repeat: the global tree and the oracle's history would hold its answer
            continue
        seen.add(run["prompt_id"])
        split = run["split_us"]
        prompt = tokenizer.render_chat([{"role": "user", "content": prompts[run["prompt_id"]]}])
        share = split.get("prefill_us", 0) / max(1, split.get("total_us", 0))
        out.setdefault(workload, []).append(Request(prompt, run["token_ids"], share))
    return out


def curve_of(results: dict, costs: str | None) -> dict[int, float]:
    if costs:
        return {int(k): float(v) for k, v in (pair.split(":") for pair in costs.split(","))}
    model = results["config"]["target_model"]
    curve = results.get("curves", {}).get(f"specdec gguf engine, {model}")
    if curve is None:
        raise SystemExit("these results hold no cost curve of the target: give --costs 1:MS,2:MS,...")
    return {int(k): v for k, v in curve.items() if k.isdigit()}


def report(table: dict[str, dict[str, dict]], curve: dict[int, float]) -> str:
    shape = ", ".join(f"{k}: {v / curve[1]:.2f}" for k, v in sorted(curve.items()))
    lines = [f"Cost of a pass by tokens scored, in steps: {shape}; a round's overhead {OVERHEAD} of a step.", ""]
    lines += ["| workload | method | tokens per round | decode speedup | end to end |", "|---|---|---|---|---|"]
    for workload, rows in table.items():
        for method, row in rows.items():
            figures = " | ".join(f"{row[key]:.2f}" for key in ("tokens_per_round", "decode_speedup", "end_to_end"))
            lines.append(f"| {workload} | {method} | {figures} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.ceiling", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a drafting or llama-cpp suite's results.json")
    parser.add_argument("--costs", help="the target's pass by tokens scored, ms: 1:28.3,2:28.9,4:47.7 (default: the results')")
    args = parser.parse_args(argv)
    from specdec.common.models import load_tokenizer

    results = json.loads(args.results.read_text())
    try:
        curve = curve_of(results, args.costs)
        cost = interpolated(curve)
    except ValueError as error:  # --costs that is not 1:MS,2:MS,... or too short a curve
        raise SystemExit(f"python -m specdec.bench.ceiling: --costs: {error}") from None
    tokenizer = load_tokenizer(results["config"]["target_model"])
    table = {workload: bounds(requests, cost) for workload, requests in requests_of(results, tokenizer).items()}
    sys.stdout.write(report(table, curve))


if __name__ == "__main__":
    main()
