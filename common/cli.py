"""The `specdec` command: serve one service, bring the local cluster up, generate, or run the demo."""

import argparse
import asyncio
import json
import os
import sys

import grpc

DEFAULT_PORTS = {"coordinator": 50051, "target": 50052, "draft": 50053}


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=["target", "draft", "coordinator"])
    serve.add_argument("--port", type=int, help="port to listen on (default: coordinator 50051, target 50052, draft 50053)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument(
        "--model", help="worker model: HF id or path, smollm2-135m, tiny-random:..., or (draft) ngram[:max=3,min=1]"
    )
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    serve.add_argument(
        "--linear",
        default="auto",
        choices=["auto", "packed", "eager"],
        help="worker: linear layers on weights packed once for oneDNN (auto: on a CPU with float32) or transformers' own",
    )
    serve.add_argument("--max-sessions", type=int, default=64, help="worker: most sessions held at once")
    serve.add_argument("--max-q-entries", type=int, default=64, help="draft: most entries of each q (K)")
    serve.add_argument("--target", help="coordinator: target worker address host:port")
    serve.add_argument("--draft", help="coordinator: draft worker address host:port (omit to run target-only)")
    serve.add_argument("--tokenizer", help="coordinator: tokenizer spec (default: the target worker's model)")
    serve.add_argument(
        "--num-speculative-tokens",
        "--gamma",
        type=int,
        dest="gamma",
        help="coordinator: default gamma; -1 (the default with a draft) chooses it each round",
    )
    serve.add_argument(
        "--overlap",
        action="store_true",
        help="coordinator: by default, draft round n+1 while the target verifies round n (pays when the workers run on "
        "separate devices or cores)",
    )
    serve.add_argument("--threads", type=int, help="worker: compute threads (torch.set_num_threads); default: PyTorch's choice")
    serve.add_argument("--cpus", help="worker: pin the process to these CPUs, e.g. 0 or 0-3 or 0,2")
    serve.add_argument("--max-num-speculative-tokens", type=int, default=16, help="coordinator: largest gamma a request may ask")
    serve.add_argument("--default-max-new-tokens", type=int, default=256)
    serve.add_argument("--max-new-tokens-cap", type=int, default=4096)
    serve.add_argument(
        "--num-p-entries", type=int, default=0, help="coordinator: top entries of p the target returns per position"
    )
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    serve.add_argument("--grace-period", type=float, default=30.0, help="on SIGTERM, seconds in-flight calls get to finish")
    serve.add_argument("--session-idle-timeout", type=float, default=600.0, help="worker: close a stream silent this long")
    serve.add_argument("--max-concurrent-requests", type=int, default=256, help="coordinator: more get RESOURCE_EXHAUSTED")
    serve.add_argument("--draft-timeout", type=float, default=2.0, help="coordinator: per-round deadline of the draft worker (s)")
    serve.add_argument(
        "--target-timeout", type=float, default=60.0, help="coordinator: per-round deadline of the target worker (s)"
    )
    serve.add_argument(
        "--target-retry-window",
        type=float,
        default=30.0,
        help="coordinator: how long a request keeps reopening a failed target session (s)",
    )
    env = os.environ.get
    tls = serve.add_argument_group(
        "TLS", "PEM files; a server given --tls-ca requires client certificates signed by it (mutual TLS)"
    )
    tls.add_argument("--tls-cert", default=env("SPECDEC_TLS_CERT"), help="this server's certificate (env SPECDEC_TLS_CERT)")
    tls.add_argument("--tls-key", default=env("SPECDEC_TLS_KEY"), help="its private key (env SPECDEC_TLS_KEY)")
    tls.add_argument(
        "--tls-ca", default=env("SPECDEC_TLS_CA"), help="CA that client certificates must chain to (env SPECDEC_TLS_CA)"
    )
    tls.add_argument(
        "--worker-tls-cert", default=env("SPECDEC_WORKER_TLS_CERT"), help="coordinator: client certificate for the workers"
    )
    tls.add_argument("--worker-tls-key", default=env("SPECDEC_WORKER_TLS_KEY"), help="coordinator: its private key")
    tls.add_argument("--worker-tls-ca", default=env("SPECDEC_WORKER_TLS_CA"), help="coordinator: CA of the workers' certificates")
    serve.add_argument(
        "--auth-token",
        default=env("SPECDEC_AUTH_TOKEN"),
        help="coordinator: require 'authorization: Bearer TOKEN' (env SPECDEC_AUTH_TOKEN)",
    )


def add_generate_parser(commands) -> None:
    generate = commands.add_parser("generate", help="send one request to a coordinator and stream the answer")
    generate.add_argument("prompt")
    generate.add_argument("--endpoint", default="localhost:50051")
    generate.add_argument("--max-new-tokens", type=int)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exactly lossless speculative decoding over gRPC")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    up = commands.add_parser("up", help="start target, draft and coordinator locally; Ctrl-C stops all three")
    up.add_argument("--target-model", default="smollm2-135m")
    up.add_argument("--draft-model", help="default: the best draft the project has for the target (ngram for smollm2-135m)")
    up.add_argument("--port", type=int, default=50051)
    up.add_argument("--device", default="cpu")
    add_generate_parser(commands)
    commands.add_parser("demo", help="bring the cluster up, stream a few answers, report acceptance and speedup")
    bench = commands.add_parser("bench", help="measure speedup against baselines and the analytic model; writes a report")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a few prompts, one repeat, at most 32 new tokens (speedup: gamma 1/2/4, under 3 minutes on the default models)",
    )
    bench.add_argument("--name", help="results go to bench/results/NAME (default: quick or full, with the date)")
    bench.add_argument("--target-model", help="default: smollm2-135m (speedup, performance), qwen2.5-coder-1.5b (pair)")
    bench.add_argument("--draft-model", help="default: the best draft the project has for the target")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=2, help="counted repeats after one warm-up")
    bench.add_argument("--output-root", default="bench/results")
    bench.add_argument(
        "--suite",
        choices=["speedup", "performance", "pair"],
        default="speedup",
        help="speedup: baselines, gamma and temperature sweeps, the analytic model; performance: schedules (auto, "
        "heuristic, fixed), concurrency sweep, overlap on separate cores; pair: a real draft/target pair against "
        "target-only, HF generate and HF assisted, with cost curves before/after packing and memory peaks",
    )
    bench.add_argument(
        "--overlap-draft-model", default="smollm2-135m#int8", help="performance: the model draft of the overlap runs"
    )
    health = commands.add_parser("health", help="exit 0 if the service at ADDRESS reports SERVING (for container health checks)")
    health.add_argument("address", nargs="?", default="localhost:50051")
    return parser


def run_serve(args) -> int:
    from common.server import configure_logging

    from common.telemetry import setup_telemetry, shutdown_telemetry

    configure_logging(args.log_level)
    port = args.port if args.port is not None else DEFAULT_PORTS[args.role]
    setup_telemetry(f"specdec-{args.role}", args.metrics_port)
    try:
        return serve_role(args, port)
    finally:
        shutdown_telemetry()


def serve_role(args, port: int) -> int:
    from common.server import ServerOptions
    from common.tls import TlsFiles

    options = ServerOptions(
        port, args.host, TlsFiles(args.tls_cert, args.tls_key, args.tls_ca), args.grace_period, args.session_idle_timeout
    )
    if args.role in ("target", "draft"):
        limit_compute(args.threads, args.cpus)
    if args.role == "target":
        from target_worker.server import serve

        asyncio.run(serve(args.model or "smollm2-135m", options, args.device, args.dtype, args.max_sessions, args.linear))
    elif args.role == "draft":
        from draft_worker.server import serve

        asyncio.run(
            serve(args.model or "ngram", options, args.device, args.dtype, args.max_sessions, args.max_q_entries, args.linear)
        )
    else:
        from coordinator.config import CoordinatorConfig
        from coordinator.engine import IncompatibleWorkers
        from coordinator.server import serve

        if not args.target:
            print("specdec serve coordinator: --target host:port is required", file=sys.stderr)
            return 2
        config = CoordinatorConfig(
            default_num_speculative_tokens=args.gamma,
            max_num_speculative_tokens=args.max_num_speculative_tokens,
            default_max_new_tokens=args.default_max_new_tokens,
            max_new_tokens_cap=args.max_new_tokens_cap,
            num_p_entries=args.num_p_entries,
            draft_timeout=args.draft_timeout,
            target_timeout=args.target_timeout,
            target_retry_window=args.target_retry_window,
            overlap=args.overlap,
        )
        worker_tls = TlsFiles(args.worker_tls_cert, args.worker_tls_key, args.worker_tls_ca)
        try:
            asyncio.run(
                serve(
                    args.target,
                    args.draft,
                    options,
                    config,
                    args.tokenizer,
                    worker_tls,
                    args.max_concurrent_requests,
                    args.auth_token,
                )
            )
        except IncompatibleWorkers as error:
            print(f"specdec coordinator refuses to start: {error}", file=sys.stderr)
            return 3
    return 0


def parse_cpus(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def limit_compute(threads: int | None, cpus: str | None) -> None:
    """Keeps a worker on its own cores: co-located workers otherwise slow each other down (PyTorch's OpenMP threads
    spin while they wait for work, on every core)."""
    import torch

    if cpus:
        os.sched_setaffinity(0, parse_cpus(cpus))
    if threads:
        torch.set_num_threads(threads)


def run_generate(args) -> int:
    from coordinator.client import GenerationClient, response_to_dict
    from coordinator.explain import explain_table

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


def run_bench_command(args) -> int:
    import time

    from coordinator.cluster import DEFAULT_TARGET_MODEL

    name = args.name or f"{'quick' if args.quick else 'full'}-{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}"
    shared = dict(
        name=name,
        draft_model=args.draft_model,
        device=args.device,
        quick=args.quick,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        output_root=args.output_root,
    )
    if args.suite == "pair":
        from bench.pair import DEFAULT_PAIR_TARGET, PairConfig, run_pair

        out = run_pair(PairConfig(target_model=args.target_model or DEFAULT_PAIR_TARGET, **shared))
    elif args.suite == "performance":
        from bench.performance import PerformanceConfig, run_performance

        target = args.target_model or DEFAULT_TARGET_MODEL
        out = run_performance(PerformanceConfig(target_model=target, overlap_draft_model=args.overlap_draft_model, **shared))
    else:
        from bench.runner import BenchConfig, run_bench

        out = run_bench(BenchConfig(target_model=args.target_model or DEFAULT_TARGET_MODEL, **shared))
    print(f"report: {out / 'report.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "up":
        from coordinator.cluster import up

        return up(args.target_model, args.draft_model, args.port, args.device)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "health":
        from coordinator.cluster import is_serving

        return 0 if is_serving(args.address) else 1
    from coordinator.demo import run_demo

    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
