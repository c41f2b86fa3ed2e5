"""What a grammar's mask costs per token: the matcher's mask computed, unpacked and applied to one row of logits,
walking a JSON answer token by token under its schema (the work the target does per verified position).

    python -m specdec.bench.grammar_mask --model qwen2.5-coder-1.5b
"""

import argparse
import json
import statistics
import time

import torch

from specdec.common.grammar import GrammarMatcher, grammar_of_schema, mask_logits, vocabulary_of
from specdec.common.models import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematician", "writer", "analyst"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
}


def measure(model: str, vocab_size: int | None, repeats: int) -> dict:
    tokenizer = load_tokenizer(model)
    start = time.perf_counter()
    vocab_size = vocab_size or len(tokenizer.hf)
    vocabulary = vocabulary_of(tokenizer, vocab_size)
    vocabulary_s = time.perf_counter() - start
    grammar = grammar_of_schema(SCHEMA)
    start = time.perf_counter()
    vocabulary.compile(grammar, "schema")
    compile_ms = (time.perf_counter() - start) * 1e3
    tokens = tokenizer.encode(json.dumps(ANSWER))
    logits = torch.randn(vocab_size)
    per_token = []
    for _ in range(repeats):
        matcher = GrammarMatcher(vocabulary.compile(grammar, "schema").deep_copy(), vocabulary)
        for token in tokens:
            t0 = time.perf_counter()
            allowed = matcher.allowed()
            masked = mask_logits(logits, allowed)
            per_token.append((time.perf_counter() - t0) * 1e6)
            assert masked[token] > float("-inf"), "the answer left the grammar"
            assert matcher.consume([token]) == 1
    return {
        "model": model,
        "vocab_size": vocab_size,
        "answer_tokens": len(tokens),
        "tokenizer_build_s": round(vocabulary_s, 2),
        "first_compile_ms": round(compile_ms, 2),
        "mask_us_median": round(statistics.median(per_token), 1),
        "mask_us_p90": round(sorted(per_token)[int(0.9 * len(per_token))], 1),
        "mask_us_max": round(max(per_token), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's logits width (default: the tokenizer's)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.vocab_size, args.repeats), indent=2))


if __name__ == "__main__":
    main()
