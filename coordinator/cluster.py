"""`specdec up`: the three services as separate local processes, stopped together."""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.common.config import DEFAULT_DRAFT_MODEL, DEFAULT_PORTS, DEFAULT_TARGET_MODEL, WorkerConfig
from specdec.draft_worker.specs import is_model_free

# The best draft the project has for each target (docs/drafting.md, "Choosing a draft"): prompt lookup for SmolLM2;
# suffix trees for the Qwen 1.5B, ahead of prompt lookup on an agent's editing loop and on input-grounded prompts and
# level with it on open-ended ones; the 0.5B sibling as a model draft pays a little on open-ended prompts only, and
# loses on the editing loop (docs/results/2026-12-07-start-up-lock-and-the-qwen-drafts.md).
DEFAULT_DRAFTS = {DEFAULT_TARGET_MODEL: DEFAULT_DRAFT_MODEL, "qwen2.5-coder-1.5b": "suffix"}
# Where the default deployment (`specdec up`, `make demo`, the llama-cpp suite's default) runs a model-free draft:
# in the coordinator. A draft worker adds an exchange to every round that asks it, including the asks that find no
# proposal; with the gguf engine's 7-30 ms steps that no longer hides. Measured on the 1.5B, 8 clients, prompt
# lookup, the two clusters alive at once and taken in turn: 1.07x the aggregate tokens/s of a draft worker (median
# of 4 pairs, 0.95-1.17); on SmolLM2 (drafting suite) ahead or level at 1-16 clients (docs/results/).
MODEL_FREE_DRAFT_IN_COORDINATOR = True
# The model draft of a target that has a sibling sharing its tokenizer (what the pair, drafting and llama-cpp benches
# compare): the cheapest exact variant of the sibling on the gguf engine, its layers in Q4_1 and its head over the
# 32768 most frequent tokens, at much the same acceptance as the plain 0.5B (docs/engines.md, "The Qwen2.5-Coder pair").
MODEL_DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b#q4_1#vocab=32768"}
# Spins of an idle OpenMP thread before it sleeps, in workers that share the cores with another model worker.
SHARED_CORES_SPIN_COUNT = 10_000
# How a service is started: the `specdec` command line (cli/), run by this interpreter.
SERVE_COMMAND = [sys.executable, "-m", "specdec.cli", "serve"]


def local_env(draft_model: str) -> dict[str, str]:
    """The environment of services that share this machine's cores.

    Two model workers: OpenMP threads that keep spinning after a parallel region take cycles from the other worker
    (libgomp spins 300,000 times by default before it sleeps), so they spin only briefly: long enough to catch the
    next region of the same pass (microseconds later), not through the other worker's turn. OMP_WAIT_POLICY=PASSIVE
    (sleep at once), used before, makes every region wake its threads: measured on the gguf engine, 2 cores, a
    1.5B step of 53-64 ms passive against 29-44 with GOMP_SPINCOUNT=10000 and 37-40 by default, and through the
    Qwen pair's cluster target-only 15-17 tok/s passive, 17-21 with the bounded spin; spinning by default made the
    rounds that used both workers erratic (10-20 tok/s).
    With a model-free draft (prompt lookup, suffix trees) only the target computes, and its threads keep their
    default.
    """
    return {} if is_model_free(draft_model) else {"GOMP_SPINCOUNT": str(SHARED_CORES_SPIN_COUNT)}


def default_draft_for(target_model: str) -> str:
    return DEFAULT_DRAFTS.get(target_model, DEFAULT_DRAFT_MODEL)


def model_draft_for(target_model: str) -> str | None:
    return MODEL_DRAFTS.get(target_model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return response.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def is_listening(port: int) -> bool:
    """Whether a local port accepts connections (the OpenAI HTTP API starts after the coordinator's gRPC health
    reports SERVING)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@dataclass
class Cluster:
    """The services as local processes: by default one of each role; targets, drafts and coordinators ask for more
    (named target-0, target-1, ...), every coordinator serving over pools of all the workers."""

    target_model: str = DEFAULT_TARGET_MODEL
    draft_model: str | None = None
    port: int = DEFAULT_PORTS["coordinator"]  # the first coordinator's
    extra_coordinator_args: list[str] = field(default_factory=list)
    extra_worker_args: list[str] = field(default_factory=list)
    target_args: list[str] = field(default_factory=list)  # for the target workers alone (e.g. --cpus 0 --threads 1)
    draft_args: list[str] = field(default_factory=list)
    device: str = WorkerConfig.device
    env: dict[str, str] = field(default_factory=dict)  # added to each service's environment (e.g. OTEL_*)
    log_dir: pathlib.Path | None = None  # each service's output goes to <name>.log there instead of the terminal
    http_port: int | None = None  # the first coordinator's OpenAI HTTP API, if any
    targets: int = 1
    drafts: int = 1  # 0: no draft worker, the coordinators run target-only
    local_draft: bool = False  # a model-free draft runs in each coordinator (--local-draft) instead of on draft workers
    # False: the targets keep no prefix cache (--prefix-cache-tokens 0), for benchmarks whose systems take turns on
    # the same prompts: the later ones would find the prompt cached by the earlier.
    prefix_cache: bool = True
    coordinators: int = 1
    instance_args: dict[str, list[str]] = field(default_factory=dict)  # by name, e.g. {"target-1": ["--cpus", "1"]}
    processes: list[subprocess.Popen] = field(default_factory=list)
    by_role: dict[str, subprocess.Popen] = field(default_factory=dict)  # by name: the role, or role-i when several
    commands: dict[str, tuple[str, ...]] = field(default_factory=dict)
    socket_dir: str | None = None  # the workers' Unix sockets

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        self.commands[name] = args
        output = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None  # noqa: SIM115 - the process owns it
        process = subprocess.Popen(
            [*SERVE_COMMAND, name.split("-")[0], *args],
            env={
                **local_env(self.draft_model or default_draft_for(self.target_model)),
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                **self.env,
            },
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
        )
        self.processes.append(process)
        self.by_role[name] = process
        return process

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would: no graceful shutdown (for fault-injection tests)."""
        self.by_role[name].kill()
        self.by_role[name].wait()

    def restart(self, name: str) -> subprocess.Popen:
        """Starts the service again on the same port, with the same arguments."""
        return self.spawn(name, *self.commands[name])

    @staticmethod
    def names(role: str, count: int) -> list[str]:
        return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]

    def spawn_worker(self, name: str, model: str, args: list[str]) -> str:
        """Starts a worker on a TCP port (for health checks and restarts) and a Unix socket (for the coordinators:
        same machine, no TCP stack on every round trip); returns the socket's address."""
        port, socket_path = free_port(), f"{self.socket_dir}/{name}.sock"
        self.addresses[name] = f"localhost:{port}"
        self.spawn(
            name,
            *("--model", model, "--port", str(port), "--unix-socket", socket_path, "--device", self.device),
            *self.extra_worker_args,
            *args,
            *self.instance_args.get(name, []),
        )
        return f"unix:{socket_path}"

    def start(self, timeout: float = 1800) -> None:
        """Starts the services and waits until every coordinator is SERVING. The timeout covers a cold first start
        on the real pair: assembling its model files, loading, packing and calibrating both workers."""
        draft_model = self.draft_model or default_draft_for(self.target_model)
        self.socket_dir = tempfile.mkdtemp(prefix="specdec-")
        self.addresses: dict[str, str] = {}
        target_args = self.target_args + ([] if self.prefix_cache else ["--prefix-cache-tokens", "0"])
        targets = [self.spawn_worker(n, self.target_model, target_args) for n in self.names("target", self.targets)]
        local = self.local_draft and is_model_free(draft_model)
        drafts = [] if local else [self.spawn_worker(n, draft_model, self.draft_args) for n in self.names("draft", self.drafts)]
        pools = ["--target", ",".join(targets)] + (["--draft", ",".join(drafts)] if drafts else [])
        pools += ["--local-draft", draft_model] if local and self.drafts else []
        self.coordinator_addresses = []
        for i, name in enumerate(self.names("coordinator", self.coordinators)):
            port = self.port if i == 0 else free_port()
            self.addresses[name] = f"localhost:{port}"
            self.coordinator_addresses.append(self.addresses[name])
            http = ["--http-port", str(self.http_port)] if i == 0 and self.http_port is not None else []
            self.spawn(name, "--port", str(port), *pools, *http, *self.extra_coordinator_args, *self.instance_args.get(name, []))
        # One worker of each role answers at these (the first), as before pools.
        self.target_address = self.addresses[self.names("target", self.targets)[0]]
        if drafts:
            self.draft_address = self.addresses[self.names("draft", self.drafts)[0]]
        deadline = time.monotonic() + timeout
        while not all(is_serving(address) for address in self.coordinator_addresses) or not (
            not self.http_port or is_listening(self.http_port)
        ):
            if any(p.poll() is not None for p in self.processes):
                self.stop()
                raise RuntimeError(
                    f"a service exited during start-up; see its log {'in ' + str(self.log_dir) if self.log_dir else 'above'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the cluster did not become healthy within {timeout:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def up(
    target_model: str,
    draft_model: str | None,
    port: int,
    device: str = WorkerConfig.device,
    http_port: int | None = None,
    local_draft: bool = MODEL_FREE_DRAFT_IN_COORDINATOR,
) -> int:
    cluster = Cluster(target_model, draft_model, port, device=device, http_port=http_port, local_draft=local_draft)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as error:  # the service's own line is above
        print(f"specdec up: {error}", file=sys.stderr)
        return 2
    http = f" and the OpenAI API at http://localhost:{http_port}/v1" if http_port is not None else ""
    print(f"specdec is serving GenerationService at {cluster.address}{http} (Ctrl-C stops every service)", flush=True)
    try:
        while not stop and all(p.poll() is None for p in cluster.processes):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0
