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

from common.config import DEFAULT_DRAFT_MODEL, DEFAULT_PORTS, DEFAULT_TARGET_MODEL, WorkerConfig
from draft_worker.ngram import is_ngram

# The best draft the project has for each target; prompt lookup for SmolLM2 (see README, "Choosing a draft").
DEFAULT_DRAFTS = {DEFAULT_TARGET_MODEL: DEFAULT_DRAFT_MODEL, "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b#int8"}
# How a service is started: the `specdec` command line (cli/), run by this interpreter.
SERVE_COMMAND = [sys.executable, "-m", "cli", "serve"]


def local_env(draft_model: str) -> dict[str, str]:
    """The environment of services that share this machine's cores.

    Two model workers: OpenMP threads that spin while waiting for work take cycles from the other worker, so they
    sleep instead (measured on the Qwen pair, 2 cores: a target step of 251-268 ms passive, 288-316 spinning).
    With prompt lookup only the target computes, and its threads' default (spin a while, then sleep) keeps its
    many small operations fast (SmolLM2 verification, 2 cores: 43-63 ms by default, 65-71 ms passive).
    """
    return {} if is_ngram(draft_model) else {"OMP_WAIT_POLICY": "PASSIVE"}


def default_draft_for(target_model: str) -> str:
    return DEFAULT_DRAFTS.get(target_model, DEFAULT_DRAFT_MODEL)


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


@dataclass
class Cluster:
    target_model: str = DEFAULT_TARGET_MODEL
    draft_model: str | None = None
    port: int = DEFAULT_PORTS["coordinator"]
    extra_coordinator_args: list[str] = field(default_factory=list)
    extra_worker_args: list[str] = field(default_factory=list)
    target_args: list[str] = field(default_factory=list)  # for the target worker alone (e.g. --cpus 0 --threads 1)
    draft_args: list[str] = field(default_factory=list)
    device: str = WorkerConfig.device
    env: dict[str, str] = field(default_factory=dict)  # added to each service's environment (e.g. OTEL_*)
    log_dir: pathlib.Path | None = None  # each service's output goes to <role>.log there instead of the terminal
    processes: list[subprocess.Popen] = field(default_factory=list)
    by_role: dict[str, subprocess.Popen] = field(default_factory=dict)
    commands: dict[str, tuple[str, ...]] = field(default_factory=dict)
    socket_dir: str | None = None  # the workers' Unix sockets

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    def spawn(self, role: str, *args: str) -> subprocess.Popen:
        self.commands[role] = args
        output = open(self.log_dir / f"{role}.log", "ab") if self.log_dir else None  # noqa: SIM115 - the process owns it
        process = subprocess.Popen(
            [*SERVE_COMMAND, role, *args],
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
        self.by_role[role] = process
        return process

    def kill(self, role: str) -> None:
        """SIGKILL, as a crash would: no graceful shutdown (for fault-injection tests)."""
        self.by_role[role].kill()
        self.by_role[role].wait()

    def restart(self, role: str) -> subprocess.Popen:
        """Starts the role again on the same port, with the same arguments."""
        return self.spawn(role, *self.commands[role])

    def start(self, timeout: float = 1800) -> None:
        """Starts the three services and waits until the coordinator is SERVING. The timeout covers a cold first
        start on the real pair: assembling its model files, loading, packing and calibrating both workers."""
        draft_model = self.draft_model or default_draft_for(self.target_model)
        target_port, draft_port = free_port(), free_port()
        self.target_address, self.draft_address = f"localhost:{target_port}", f"localhost:{draft_port}"
        # The coordinator reaches the workers over Unix sockets: same machine, no TCP stack on every round trip.
        self.socket_dir = tempfile.mkdtemp(prefix="specdec-")
        target_socket, draft_socket = f"{self.socket_dir}/target.sock", f"{self.socket_dir}/draft.sock"
        self.spawn(
            "target",
            "--model",
            self.target_model,
            "--port",
            str(target_port),
            "--unix-socket",
            target_socket,
            "--device",
            self.device,
            *self.extra_worker_args,
            *self.target_args,
        )
        self.spawn(
            "draft",
            "--model",
            draft_model,
            "--port",
            str(draft_port),
            "--unix-socket",
            draft_socket,
            "--device",
            self.device,
            *self.extra_worker_args,
            *self.draft_args,
        )
        self.spawn(
            "coordinator",
            "--port",
            str(self.port),
            "--target",
            f"unix:{target_socket}",
            "--draft",
            f"unix:{draft_socket}",
            *self.extra_coordinator_args,
        )
        deadline = time.monotonic() + timeout
        while not is_serving(self.address):
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


def up(target_model: str, draft_model: str | None, port: int, device: str = WorkerConfig.device) -> int:
    cluster = Cluster(target_model, draft_model, port, device=device)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    cluster.start()
    print(f"specdec is serving GenerationService at {cluster.address} (Ctrl-C stops all three services)", flush=True)
    try:
        while not stop and all(p.poll() is None for p in cluster.processes):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0
