"""`specdec bench --suite prefill`: what a long prompt arriving mid-stream does to the other streams.

Four clients stream answers from the three services; while they do, a fifth sends a prompt of several thousand
tokens. Each stream's inter-token gaps (the time between two streamed messages) are recorded: the largest gap of
each stream while the long prompt is prefilled is the delay the prefill cost it. Measured twice, interleaved, in
one run: with the whole prompt in one pass (--max-prefill-tokens-per-pass above the prompt's length: the
behaviour before chunked prefill) and with the default chunk. Every stream's tokens are also checked against its
output without the long prompt.
"""

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from specdec.bench.runner import machine_description
from specdec.common.config import DEFAULT_TARGET_MODEL, WorkerConfig
from specdec.coordinator.client import GenerationClient
from specdec.coordinator.cluster import Cluster, free_port

STREAMS = 4
UNCHUNKED = 1 << 20  # a chunk no prompt reaches: one pass per prefill


@dataclass
class PrefillConfig:
    name: str
    target_model: str = DEFAULT_TARGET_MODEL
    draft_model: str = "ngram"
    long_prompt_tokens: int = 4000
    chunk: int = WorkerConfig.max_prefill_tokens_per_pass
    max_new_tokens: int = 160  # per stream: long enough to outlast the long prompt's prefill
    repeats: int = 2
    quick: bool = False
    output_root: str = "bench/results"
    device: str = WorkerConfig.device

    def __post_init__(self):
        if self.quick:
            self.repeats, self.long_prompt_tokens = 1, 2000


def long_prompt(tokens: int) -> str:
    """A prompt of about `tokens` tokens: numbered lines of a log, text the model does not shorten."""
    return "".join(f"line {i}: request served in {(i * 37) % 997} ms\n" for i in range(tokens // 12))


def stream_gaps(client: GenerationClient, prompt: str, max_new_tokens: int) -> tuple[list[float], list[int]]:
    """(time of each streamed message, tokens) of one greedy stream."""
    times, tokens = [], []
    for message in client.stream(prompt, max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True):
        times.append(time.perf_counter())
        if message.HasField("delta"):
            tokens.extend(message.delta.token_ids)
    return times, tokens


def one_wave(address: str, config: PrefillConfig, with_long: bool) -> dict:
    """The four streams, and (with_long) the long prompt sent once they are under way."""
    results: dict[int, tuple[list[float], list[int]]] = {}
    long_window: list[float] = []

    errors: list[str] = []

    def stream(i: int) -> None:
        with GenerationClient(address) as client:
            try:
                results[i] = stream_gaps(client, f"Count from {i * 10} upwards, one number per line:", config.max_new_tokens)
            except grpc.RpcError as error:
                errors.append(f"stream {i}: {error.code().name}: {error.details()}")
                results[i] = ([], [])

    def long_request() -> None:
        with GenerationClient(address) as client:
            time.sleep(1.0)  # the streams are under way
            long_window.append(time.perf_counter())
            try:
                client.generate(long_prompt(config.long_prompt_tokens), max_new_tokens=1, temperature=0)
            except grpc.RpcError as error:
                errors.append(f"long prompt: {error.code().name}: {error.details()}")
            long_window.append(time.perf_counter())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    if with_long:
        threads.append(threading.Thread(target=long_request))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    start, end = long_window if with_long else (0.0, float("inf"))
    worst = []
    for i in range(STREAMS):
        times = results[i][0]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= start and a <= end]
        worst.append(max(gaps, default=0.0))
    all_gaps = [b - a for i in range(STREAMS) for a, b in zip(results[i][0], results[i][0][1:], strict=False)]
    return {
        "worst_gap_ms": [round(g * 1000, 1) for g in worst],
        "median_gap_ms": round(statistics.median(all_gaps) * 1000, 1) if all_gaps else None,
        "errors": errors,
        "prefill_s": round(end - start, 2) if with_long else None,
        "tokens": {i: results[i][1] for i in range(STREAMS)},
    }


def run_prefill(config: PrefillConfig) -> Path:
    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for chunk in (UNCHUNKED, config.chunk):
        args = ["--max-prefill-tokens-per-pass", str(chunk)]
        with Cluster(
            config.target_model,
            config.draft_model,
            free_port(),
            device=config.device,
            target_args=args,
            draft_args=args,
            log_dir=out,
            prefix_cache=False,
        ) as cluster:
            alone = one_wave(cluster.address, config, with_long=False)
            for repeat in range(config.repeats):
                wave = one_wave(cluster.address, config, with_long=True)
                rows.append(
                    {
                        "chunk": None if chunk == UNCHUNKED else chunk,
                        "repeat": repeat,
                        "worst_gap_ms": wave["worst_gap_ms"],
                        "median_gap_ms": wave["median_gap_ms"],
                        "median_gap_alone_ms": alone["median_gap_ms"],
                        "prefill_s": wave["prefill_s"],
                        "outputs_unchanged": wave["tokens"] == alone["tokens"],
                        "errors": wave["errors"],
                    }
                )
    report = {"config": asdict(config), "machine": machine_description(), "rows": rows}
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report))
    return out


def report_markdown(report: dict) -> str:
    config = report["config"]
    lines = [
        f"# Prefill interference ({config['name']})",
        "",
        f"{STREAMS} greedy streams of {config['max_new_tokens']} tokens on {config['target_model']} "
        f"(draft {config['draft_model']}); a prompt of about {config['long_prompt_tokens']} tokens arrives once they "
        f"are under way. {report['machine']['processor']}, {report['machine']['torch_threads']} threads.",
        "",
        "| prefill | worst gap of each stream during the long prefill (ms) | median gap (ms) | alone (ms) | long prefill (s) "
        "| outputs unchanged | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        chunk = "one pass" if row["chunk"] is None else f"chunks of {row['chunk']}"
        worst = " / ".join(f"{g:.0f}" for g in row["worst_gap_ms"])
        median = "-" if row["median_gap_ms"] is None else f"{row['median_gap_ms']:.0f}"
        errors = "; ".join(row.get("errors", [])) or "none"
        lines.append(
            f"| {chunk} | {worst} | {median} | {row['median_gap_alone_ms']:.0f} | "
            f"{row['prefill_s']:.2f} | {'yes' if row['outputs_unchanged'] else 'NO'} | {errors} |"
        )
    return "\n".join(lines) + "\n"
