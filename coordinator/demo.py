"""`make demo`: the local cluster on the default models, a few prompts streamed, and the measured speedup."""

import time

from coordinator.client import GenerationClient
from coordinator.cluster import Cluster

PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, flows thruogh Liechtenstein, Austria, Germany, France "
    "and the Netherlands, and empties into the Nroth Sea. It is about 1,230 kilometres long and has long been "
    "one of Europe's most importnat waterways for trade."
)

# Input-grounded prompts (the answer copies from the prompt, where prompt lookup pays) and open questions
# (where it mostly misses and speculation costs a little).
DEMO_PROMPTS = [
    ("fix typos", f"Fix the typos in this text and return the corrected text:\n\n{PASSAGE}"),
    ("to table", "Convert this list to a Markdown table with columns Name and Age:\nAlice, 31\nBob, 27\nCarol, 45\nDave, 38"),
    ("summarise", f"Summarise this passage in one sentence:\n\n{PASSAGE}"),
    ("open question", "Give three tips for writing clear technical documentation."),
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


def run_demo(max_new_tokens: int = 96) -> int:
    print("Starting the cluster (target smollm2-135m, draft ngram prompt lookup)...", flush=True)
    with Cluster() as cluster, GenerationClient(cluster.address) as client:
        timed_generation(client, "Hello", None, 8, echo=False)  # warm-up
        rows = []
        for category, prompt in DEMO_PROMPTS:
            print(f"\n=== {category}: {prompt.splitlines()[0][:70]}")
            spec, spec_s = timed_generation(client, prompt, None, max_new_tokens, echo=True)
            plain, plain_s = timed_generation(client, prompt, 0, max_new_tokens, echo=False)
            tokens = spec.usage.completion_tokens
            same = list(spec.token_ids) == list(plain.token_ids)
            rows.append((category, spec.speculation.acceptance_rate, tokens / spec_s, tokens / plain_s, plain_s / spec_s, same))
            stats = spec.speculation
            print(
                f"\n--- acceptance {stats.acceptance_rate:.2f}, {stats.mean_tokens_per_round:.2f} tokens/round, "
                f"{tokens / spec_s:.1f} tok/s vs {len(plain.token_ids) / plain_s:.1f} tok/s target-only: "
                f"speedup {plain_s / spec_s:.2f}x, output identical to target-only: {same}"
            )
        print("\ncategory        acceptance  spec tok/s  target-only tok/s  speedup  identical")
        for category, acceptance, spec_tps, plain_tps, speedup, same in rows:
            print(f"{category:<15} {acceptance:>10.2f} {spec_tps:>11.1f} {plain_tps:>18.1f} {speedup:>7.2f}x  {same}")
    return 0
