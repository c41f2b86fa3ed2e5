"""`python -m specdec.bench.draft_ceiling`: how far a model draft could speed up greedy decoding, worked out offline.

A greedy answer is deterministic, and so is a greedy draft's proposal given the answer so far: one target-only
answer per prompt and one pass of the draft over prompt and answer (teacher forcing) give every proposal's fate.
A round at position i with gamma g accepts the draft's run of agreements from i, at most g, and commits one token
more (the target's correction or bonus). Its cost, in target steps: g draft steps and the target's pass over g + 1
tokens (the pass curve measured here). Per prompt, the best fixed gamma, and the hindsight oracle that drafts
exactly the run that will be accepted (nothing where the draft disagrees at once), at the draft's measured step and
at hypothetical ones: what the draft's step must come down to for a model draft to pay.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec.bench.ceiling import interpolated
from specdec.bench.runner import load_prompts
from specdec.common.model_runner import CALIBRATION_CONTEXT
from specdec.common.models import load_model

CAP = 8  # most tokens a round drafts
ROWS = (1, 2, 3, 4, 5, 6, 8, 9)


def greedy_answer(loaded, prompt: list[int], tokens: int) -> list[int]:
    runner, eos = loaded.runner, set(loaded.tokenizer.eos_token_ids)
    cache, answer = runner.new_cache(), []
    logits = runner.forward([cache], [prompt], [1])[0]
    while len(answer) < tokens:
        answer.append(int(logits[-1].argmax()))
        if answer[-1] in eos:
            break
        logits = runner.forward([cache], [answer[-1:]], [1])[0]
    return answer


def draft_agreement(draft, prompt: list[int], answer: list[int]) -> list[bool]:
    """Whether the draft's greedy token at each position of the answer, given the answer before it, is the answer's."""
    rows = draft.runner.forward([draft.runner.new_cache()], [prompt + answer], [len(answer) + 1])[0]
    return [int(row.argmax()) == token for row, token in zip(rows, answer, strict=False)]


def pass_timer(loaded):
    """A timer of passes over `rows` new tokens on one cache holding CALIBRATION_CONTEXT tokens, cropped back after
    each, so that every timing finds the same warm cache (as the runner's own calibration does)."""
    runner, vocab = loaded.runner, loaded.vocab_size
    cache = runner.new_cache()
    runner.forward([cache], [[t % vocab for t in range(100, 100 + CALIBRATION_CONTEXT)]], [1])

    def pass_ms(rows: int) -> float:
        start = time.perf_counter()
        runner.forward([cache], [[t % vocab for t in range(300, 300 + rows)]], [rows])
        elapsed = (time.perf_counter() - start) * 1e3
        runner.crop_to(cache, CALIBRATION_CONTEXT)
        return elapsed

    return pass_ms


def measured_costs(target, drafts: dict, repeats: int) -> tuple[dict[int, float], dict[str, float]]:
    """The target's pass curve and each draft's 1-token step (ms), interleaved, medians of `repeats`."""
    target_pass, draft_steps = pass_timer(target), {name: pass_timer(draft) for name, draft in drafts.items()}
    curve, steps = {rows: [] for rows in ROWS}, {name: [] for name in drafts}
    for _ in range(repeats):
        for rows in ROWS:
            curve[rows].append(target_pass(rows))
        for name, draft_pass in draft_steps.items():
            steps[name].append(draft_pass(1))
    return {r: statistics.median(v) for r, v in curve.items()}, {n: statistics.median(v) for n, v in steps.items()}


def replayed_speedup(agree: list[bool], pass_cost, draft_step: float, gamma: int | None) -> float:
    """Tokens per target step over the answer, drafting `gamma` tokens a round (None: the hindsight oracle)."""
    position, cost = 0, 0.0
    while position < len(agree):
        run = 0
        while position + run < len(agree) and agree[position + run] and run < CAP:
            run += 1
        drafted = run if gamma is None else gamma
        cost += drafted * draft_step + pass_cost(drafted + 1)
        position += min(run, drafted) + 1
    return len(agree) / cost


def ceilings(agree: list[bool], pass_cost, draft_step: float) -> dict:
    fixed = {g: replayed_speedup(agree, pass_cost, draft_step, g) for g in range(1, CAP + 1)}
    best = max(fixed, key=fixed.get)
    return {"best_gamma": best, "best_fixed": fixed[best], "oracle": replayed_speedup(agree, pass_cost, draft_step, None)}


def run(target_spec: str, draft_specs: list[str], tokens: int, repeats: int, hypothetical: list[float], limit: int | None):
    target = load_model(target_spec, engine="auto")
    drafts = {spec: load_model(spec, engine="auto") for spec in draft_specs}
    prompts = load_prompts(None)[:limit]
    answers = [(p["id"], p["category"], *chat_answer(target, p["prompt"], tokens)) for p in prompts]
    curve, steps = measured_costs(target, drafts, repeats)
    pass_cost = interpolated(curve)
    results = {"target": target_spec, "curve_ms": curve, "draft_step_ms": steps, "prompts": []}
    for pid, category, prompt, answer in answers:
        entry = {"id": pid, "category": category, "tokens": len(answer), "drafts": {}}
        for spec, draft in drafts.items():
            agree = draft_agreement(draft, prompt, answer)
            costs = {"measured": steps[spec] / curve[1], **{f"{c:.2f}": c for c in hypothetical}}
            entry["drafts"][spec] = {
                "agreement": sum(agree) / len(agree),
                "ceilings": {name: ceilings(agree, pass_cost, c) for name, c in costs.items()},
            }
        results["prompts"].append(entry)
    return results


def chat_answer(target, text: str, tokens: int) -> tuple[list[int], list[int]]:
    """The prompt as the chat template renders a user's message, and the target's greedy answer to it."""
    prompt = target.tokenizer.render_chat([{"role": "user", "content": text}])
    return prompt, greedy_answer(target, prompt, tokens)


def report(results: dict) -> str:
    curve = results["curve_ms"]
    lines = [
        f"target {results['target']}: step {curve[1]:.1f} ms; pass curve in steps "
        + ", ".join(f"{rows}: {ms / curve[1]:.2f}" for rows, ms in curve.items()),
        "draft steps: " + ", ".join(f"{spec} {ms:.1f} ms ({ms / curve[1]:.2f})" for spec, ms in results["draft_step_ms"].items()),
        "",
        "| prompt | category | draft | agreement | draft step | best fixed gamma | x | oracle x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["prompts"]:
        for spec, figures in entry["drafts"].items():
            for name, c in figures["ceilings"].items():
                lines.append(
                    f"| {entry['id']} | {entry['category']} | {spec} | {figures['agreement']:.2f} | {name} | "
                    f"{c['best_gamma']} | {c['best_fixed']:.2f} | {c['oracle']:.2f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.draft_ceiling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", action="append", help="a draft model spec (repeatable; default the 0.5B)")
    parser.add_argument("--tokens", type=int, default=128, help="greedy answer tokens per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings of the pass curve and draft steps")
    parser.add_argument("--hypothetical", type=float, nargs="*", default=[0.3, 0.2], help="draft steps to price, in target steps")
    parser.add_argument("--prompts", type=int, default=None, help="the bench's first N prompts (default all)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the results as JSON")
    args = parser.parse_args()
    results = run(args.target, args.draft or ["qwen2.5-coder-0.5b"], args.tokens, args.repeats, args.hypothetical, args.prompts)
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
