"""The `specdec` command: serve one service, bring the local cluster up, generate, benchmark, or run the demo."""

import argparse
import json
import os
import sys

from specdec.cli.serve import add_serve_parser, run_serve
from specdec.common.config import DEFAULT_PORTS, DEFAULT_TARGET_MODEL, WorkerConfig

COORDINATOR_ADDRESS = f"localhost:{DEFAULT_PORTS['coordinator']}"


def add_generate_parser(commands) -> None:
    generate = commands.add_parser("generate", help="send one request to a coordinator and stream the answer")
    generate.add_argument("prompt")
    generate.add_argument("--endpoint", default=COORDINATOR_ADDRESS, help="the coordinator (default: %(default)s)")
    generate.add_argument("--max-new-tokens", type=int, help="default: the coordinator's --default-max-new-tokens")
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--gamma", type=int, help="draft tokens per round; -1 auto, 0 turns speculation off")
    generate.add_argument("--overlap", action=argparse.BooleanOptionalAction, help="draft while the target verifies")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    generate.add_argument("--explain", action="store_true", help="after the text, print where each round's time went")
    generate.add_argument("--token", default=os.environ.get("SPECDEC_AUTH_TOKEN"), help="bearer token (env SPECDEC_AUTH_TOKEN)")
    generate.add_argument(
        "--tls-ca", default=os.environ.get("SPECDEC_TLS_CA"), help="CA of the coordinator's certificate (enables TLS)"
    )
    generate.add_argument("--timeout", type=float, help="seconds before the request is abandoned")


def add_bench_parser(commands) -> None:
    """The suites' own configs (bench.runner.BenchConfig, bench.performance.PerformanceConfig, bench.pair.PairConfig)
    hold their defaults: a flag left out is not passed on."""
    bench = commands.add_parser("bench", help="measure speedup against baselines and the analytic model; writes a report")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a few prompts, one repeat, at most 32 new tokens (speedup: gamma 1/2/4, under 3 minutes on the default models)",
    )
    bench.add_argument("--name", help="default: quick or full, with the suite and the date")
    bench.add_argument("--target-model", help="default: smollm2-135m (speedup, performance), qwen2.5-coder-1.5b (pair)")
    bench.add_argument("--draft-model", help="default: the best draft the project has for the target")
    bench.add_argument("--device", help="default: the suite's")
    bench.add_argument("--max-new-tokens", type=int, help="most new tokens per request (default: the suite's)")
    bench.add_argument("--repeats", type=int, help="counted repeats after one warm-up (default: the suite's)")
    bench.add_argument("--output-root", help="results go to OUTPUT_ROOT/NAME (default: the suite's)")
    bench.add_argument(
        "--suite",
        choices=list(BENCH_SUITES),
        default="speedup",
        help="speedup: baselines, gamma and temperature sweeps, the analytic model; performance: schedules (auto, "
        "heuristic, fixed), concurrency sweep, overlap on separate cores; pair: a real draft/target pair against "
        "target-only, HF generate and HF assisted, with cost curves before/after packing and memory peaks; overhead: "
        "per-round overhead beyond compute (median, p95 µs) against the gRPC floor, and gRPC vs in-process; scale: one "
        "target worker against two (tokens/s, session spread) and a fault run over 2 targets, 2 drafts, 2 coordinators; "
        "llama-cpp: the gguf engine against llama.cpp on the same files and threads (cost curves, end to end); prefill: "
        "what a long prompt arriving mid-stream does to 4 streams' inter-token gaps, in one pass and chunked; drafting: "
        "target-only, prompt lookup, suffix trees and a model draft on an agent's editing loop and on input-grounded "
        "prompts, and a concurrency sweep with the model-free drafts on a draft worker and in the coordinator; roofline: "
        "the gguf engine's kernels (each format, the attention, the whole pass) at 1-512 rows against the machine's "
        "measured int8 peak and memory bandwidth, and where a pass's time goes",
    )
    bench.add_argument(
        "--gamma", type=int, help="drafting: the drafting systems' draft tokens per round (default: -1, auto gamma)"
    )
    bench.add_argument("--overlap-draft-model", help="performance: the model draft of the overlap runs (default: the suite's)")
    bench.add_argument(
        "--concurrency",
        help="drafting: the sweep's client counts, comma-separated (default: 1,2,4,8,16); 'none' skips the sweep",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exactly lossless speculative decoding over gRPC")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    up = commands.add_parser("up", help="start target, draft and coordinator locally; Ctrl-C stops all three")
    up.add_argument("--target-model", default=DEFAULT_TARGET_MODEL, help="(default: %(default)s)")
    up.add_argument("--draft-model", help="default: the best draft the project has for the target (ngram for smollm2-135m)")
    up.add_argument("--port", type=int, default=DEFAULT_PORTS["coordinator"], help="the coordinator's (default: %(default)s)")
    up.add_argument("--device", default=WorkerConfig.device, help="both workers' (default: %(default)s)")
    up.add_argument(
        "--http-port", type=int, default=DEFAULT_PORTS["http"], help="the OpenAI-compatible HTTP API's (default: %(default)s)"
    )
    up.add_argument("--no-http", action="store_true", help="serve the gRPC API only")
    up.add_argument(
        "--draft-worker",
        action="store_true",
        help="run a model-free draft (ngram, suffix) on a draft worker; by default it runs in the coordinator (a model "
        "draft always has a worker)",
    )
    add_generate_parser(commands)
    commands.add_parser("demo", help="bring the cluster up, stream a few answers, report acceptance and speedup")
    add_bench_parser(commands)
    status = commands.add_parser("status", help="the coordinator's worker pools: members, health, open sessions")
    status.add_argument("address", nargs="?", default=COORDINATOR_ADDRESS)
    status.add_argument("--json", action="store_true", help="print the GetStatus answer as JSON")
    status.add_argument("--token", default=os.environ.get("SPECDEC_AUTH_TOKEN"), help="bearer token (env SPECDEC_AUTH_TOKEN)")
    health = commands.add_parser("health", help="exit 0 if the service at ADDRESS reports SERVING (for container health checks)")
    health.add_argument("address", nargs="?", default=COORDINATOR_ADDRESS)
    return parser


def run_generate(args) -> int:
    import grpc

    from specdec.coordinator.client import GenerationClient, response_to_dict
    from specdec.coordinator.explain import explain_table

    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        num_speculative_tokens=args.gamma,
        overlap=args.overlap,
        include_rounds=args.explain,
    )
    try:
        with GenerationClient(args.endpoint, timeout=args.timeout, token=args.token, tls_ca=args.tls_ca) as client:
            if args.json:
                response = client.generate(prompt, **options)
                print(json.dumps(response_to_dict(response)))
            else:
                for message in client.stream(prompt, **options):
                    if message.HasField("delta"):
                        print(message.delta.text, end="", flush=True)
                    else:
                        response = message.final
                print()
            if args.explain:
                print(explain_table(response), file=sys.stderr if args.json else sys.stdout)
    except grpc.RpcError as error:
        print(f"specdec generate: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    return 0


def status_table(status) -> str:
    from specdec.v1 import generation_pb2, worker_pb2

    members = [(pool, m) for pool in status.pools for m in pool.members]
    width = max([len("address"), *(len(m.address) for _, m in members)]) + 2
    lines = [
        f"target model {status.target_model}, draft model {status.draft_model or '-'}, {status.active_requests} requests running",
        f"{'pool':<7}{'address':<{width}}{'health':<13}{'sessions':>9}{'ours':>6}{'placed':>8}  model / detail",
    ]
    for pool in status.pools:
        role = worker_pb2.WorkerRole.Name(pool.role).removeprefix("WORKER_ROLE_").lower()
        if not pool.members:
            lines.append(f"{role:<7}({', '.join(pool.configured)} resolves to no address)")
        for m in pool.members:
            health = generation_pb2.MemberHealth.Name(m.health).removeprefix("MEMBER_HEALTH_").lower()
            lines.append(
                f"{role:<7}{m.address:<{width}}{health:<13}{m.sessions:>9}{m.coordinator_sessions:>6}{m.sessions_placed:>8}  "
                f"{m.model_name}{'  ' + m.detail if m.detail else ''}"
            )
    return "\n".join(lines)


def run_status(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from specdec.coordinator.client import GenerationClient

    try:
        with GenerationClient(args.address, token=args.token) as client:
            status = client.status()
    except grpc.RpcError as error:
        print(f"specdec status: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(json.dumps(MessageToDict(status)) if args.json else status_table(status))
    return 0


# Each suite: its module, config class and run function, and the common settings it does not take.
BENCH_SUITES = {
    "speedup": ("specdec.bench.runner", "BenchConfig", "run_bench", ()),
    "pair": ("specdec.bench.pair", "PairConfig", "run_pair", ()),
    "overhead": ("specdec.bench.overhead", "OverheadConfig", "run_overhead", ()),
    "scale": ("specdec.bench.scale", "ScaleConfig", "run_scale", ()),
    "llama-cpp": ("specdec.bench.llama_cpp", "LlamaCppConfig", "run_llama_cpp", ("device",)),
    "prefill": ("specdec.bench.prefill_interference", "PrefillConfig", "run_prefill", ()),
    "drafting": ("specdec.bench.drafting", "DraftingConfig", "run_drafting", ()),
    "roofline": ("specdec.bench.roofline", "RooflineConfig", "run_roofline", ("device", "draft_model", "max_new_tokens")),
    "performance": ("specdec.bench.performance", "PerformanceConfig", "run_performance", ()),
}


def suite_settings(args) -> dict:
    """The settings given on the command line that the chosen suite takes."""
    *_, not_taken = BENCH_SUITES.get(args.suite, BENCH_SUITES["speedup"])
    keys = ("target_model", "draft_model", "device", "max_new_tokens", "repeats", "output_root")
    given = {key: getattr(args, key) for key in keys if getattr(args, key) is not None and key not in not_taken}
    if args.suite == "drafting" and args.gamma is not None:
        given["gamma"] = args.gamma
    if args.suite == "drafting" and args.concurrency is not None:
        given["concurrency"] = [] if args.concurrency == "none" else [int(n) for n in args.concurrency.split(",")]
    if args.suite == "performance" and args.overlap_draft_model is not None:
        given["overlap_draft_model"] = args.overlap_draft_model
    return given


def run_bench_command(args) -> int:
    import importlib
    import time

    for flag, value in (("--gamma", args.gamma), ("--concurrency", args.concurrency)):
        if value is not None and args.suite != "drafting":
            print(f"specdec bench: {flag} applies to --suite drafting only", file=sys.stderr)
            return 2
    name = args.name or f"{'quick' if args.quick else 'full'}-{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}"
    module_name, config_name, run_name, _ = BENCH_SUITES.get(args.suite, BENCH_SUITES["speedup"])
    module = importlib.import_module(module_name)
    config = getattr(module, config_name)(name=name, quick=args.quick, **suite_settings(args))
    out = getattr(module, run_name)(config)
    print(f"report: {out / 'report.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "up":
        from specdec.coordinator.cluster import up

        return up(
            args.target_model,
            args.draft_model,
            args.port,
            args.device,
            None if args.no_http else args.http_port,
            not args.draft_worker,
        )
    if args.command == "generate":
        return run_generate(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "status":
        return run_status(args)
    if args.command == "health":
        from specdec.coordinator.cluster import is_serving

        return 0 if is_serving(args.address) else 1
    from specdec.coordinator.demo import run_demo

    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
