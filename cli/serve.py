"""`specdec serve ROLE`: one service in this process. Its flags are derived from the services' settings classes
(common.config.add_arguments): every default is the one written in those classes."""

import argparse
import asyncio
import logging
import os
import sys

from specdec.common import startup_turn
from specdec.common.config import (
    DEFAULT_PORTS,
    ConfigError,
    DraftWorkerConfig,
    ServerOptions,
    WorkerConfig,
    add_arguments,
    from_arguments,
)
from specdec.coordinator.config import CoordinatorConfig, CoordinatorServerConfig, HttpSettings, PoolSettings

# The settings classes each role's flags come from; ServerOptions' flags are every role's.
ROLE_SETTINGS = {
    "target": (WorkerConfig,),
    "draft": (DraftWorkerConfig,),
    "coordinator": (CoordinatorServerConfig, CoordinatorConfig, PoolSettings, HttpSettings),
}
ROLE_HELP = {
    "target": "the target worker: verifies drafted tokens with the large model",
    "draft": "the draft worker: proposes tokens with a small model or prompt lookup",
    "coordinator": "GenerationService, the client API: runs the speculation rounds over both workers",
}


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True, metavar="{target,draft,coordinator}")
    for role, settings in ROLE_SETTINGS.items():
        parser = roles.add_parser(role, help=ROLE_HELP[role], description=ROLE_HELP[role])
        # Idle sessions are the workers'; the coordinator's requests are bounded by their own deadlines.
        skip = ("session_idle_timeout",) if role == "coordinator" else ()
        add_arguments(parser, ServerOptions, skip=skip, defaults={"port": DEFAULT_PORTS[role]})
        for cls in settings:
            add_arguments(parser, cls)


def run_serve(args: argparse.Namespace) -> int:
    from specdec.common.lifecycle import configure_logging
    from specdec.common.telemetry import setup_telemetry, shutdown_telemetry

    configure_logging(args.log_level)
    options = from_arguments(args, ServerOptions)
    # Before the imports, which take a core for seconds: a worker calibrating beside them would measure their load.
    startup_turn.begin(options.startup_lock)
    setup_telemetry(f"specdec-{args.role}", options.metrics_port)
    try:
        return serve_role(args, options)
    except ConfigError as error:
        print(f"specdec serve {args.role}: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - any failure to start is one line; its traceback goes to the debug log
        logging.getLogger("specdec").debug("specdec serve %s failed", args.role, exc_info=True)
        print(f"specdec serve {args.role}: cannot start: {startup_reason(error)}", file=sys.stderr)
        return 2
    finally:
        startup_turn.end()
        shutdown_telemetry()


def startup_reason(error: Exception) -> str:
    """An error as one line: specdec's own errors say what and where (the file, the field); others add their type."""
    from specdec.common.errors import SpecdecError

    text = str(error) if isinstance(error, SpecdecError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def serve_role(args: argparse.Namespace, options: ServerOptions) -> int:
    from specdec.common.memory import keep_freed_memory

    if args.role == "target":
        from specdec.target_worker.server import serve

        config = from_arguments(args, WorkerConfig)
        limit_compute(config.threads, config.cpus)
        keep_freed_memory()
        asyncio.run(serve(config, options))
    elif args.role == "draft":
        from specdec.draft_worker.server import serve

        config = from_arguments(args, DraftWorkerConfig)
        limit_compute(config.threads, config.cpus)
        keep_freed_memory()
        asyncio.run(serve(config, options))
    else:
        from specdec.coordinator.workers import IncompatibleWorkers
        from specdec.coordinator.server import serve

        settings = from_arguments(args, CoordinatorServerConfig)
        if not settings.target:
            print("specdec serve coordinator: --target host:port is required", file=sys.stderr)
            return 2
        startup_turn.end()  # imported: what the coordinator does next is wait for its workers
        try:
            configs = (from_arguments(args, cls) for cls in (CoordinatorConfig, PoolSettings, HttpSettings))
            asyncio.run(serve(settings, options, *configs))
        except IncompatibleWorkers as error:
            print(f"specdec serve coordinator: cannot start: {startup_reason(error)}", file=sys.stderr)
            return 2
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
