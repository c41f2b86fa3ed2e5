"""Tokens/s of a coordinator already serving (a container cluster, `specdec up`, a remote one): the bench's prompts
sent one after another as greedy requests, after one warm-up request; the same figure for any deployment, so two
can be compared on one machine (docs/docker.md compares the compose cluster with `specdec up`).

    python -m specdec.bench.endpoint 127.0.0.1:50051 --requests 8 --max-new-tokens 64
"""

import argparse
import json
import pathlib
import time

from specdec.coordinator.client import GenerationClient

PROMPTS = pathlib.Path(__file__).with_name("prompts.json")


def measure(address: str, requests: int, max_new_tokens: int, repeats: int) -> dict:
    prompts = [p["prompt"] for p in json.loads(PROMPTS.read_text())][:requests]
    options = dict(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    with GenerationClient(address, timeout=600) as client:
        client.generate(prompts[0], **options)  # warm-up: first-call costs (allocations, caches) are not counted
        runs = []
        for _ in range(repeats):
            tokens, drafted, accepted, started = 0, 0, 0, time.perf_counter()
            for prompt in prompts:
                response = client.generate(prompt, **options)
                tokens += response.usage.completion_tokens
                drafted += response.speculation.drafted_tokens
                accepted += response.speculation.accepted_tokens
            runs.append(tokens / (time.perf_counter() - started))
    return {
        "address": address,
        "requests": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tokens_per_s": sorted(runs)[len(runs) // 2],
        "runs_tokens_per_s": runs,
        "acceptance": accepted / drafted if drafted else 0.0,
        "drafted_tokens": drafted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.endpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051")
    parser.add_argument("--requests", type=int, default=8, help="prompts from bench/prompts.json (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs over the prompts; the median is reported")
    args = parser.parse_args()
    print(json.dumps(measure(args.address, args.requests, args.max_new_tokens, args.repeats)))


if __name__ == "__main__":
    main()
