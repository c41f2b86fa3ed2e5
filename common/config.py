"""Settings shared by the services, and the one place their defaults are written.

Each setting is a dataclass field made by setting(): its default and its help text. The command line is derived
from these classes (add_arguments, from_arguments): a flag --max-sessions exists because WorkerConfig has a field
max_sessions, and its default is that field's default. This module imports no service: the services import it.
"""

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import MISSING, dataclass

from specdec.common.startup_turn import default_lock_path
from specdec.common.tls import TlsFiles
from specdec.common.wire_limits import MAX_Q_ENTRIES

DEFAULT_PORTS = {"coordinator": 50051, "target": 50052, "draft": 50053, "http": 8000}  # http: the OpenAI API
DEFAULT_TARGET_MODEL = "smollm2-135m"
DEFAULT_DRAFT_MODEL = "ngram"  # prompt lookup: needs no model files and suits any target


class ConfigError(ValueError):
    """A setting that cannot work, found before a service starts: `specdec serve` prints it and exits with 2."""


def setting(
    default=None,
    help: str = "",
    *,
    flags: tuple[str, ...] | None = None,
    env: str | None = None,
    group: tuple[str, str] | None = None,
    parts: dict[str, tuple[str, str | None]] | None = None,
    cli: bool = True,
    **argparse_options,
):
    """A dataclass field whose default and help also make a command-line flag.

    flags: option strings (default: --field-name); env: an environment variable that overrides the default on the
    command line; group: (title, description) of the --help section it is listed in; parts: for a field holding a
    small dataclass (TlsFiles), one flag per part, {part: (help, env)}, named --field-part; cli: False for a
    setting that is no flag; argparse_options: passed to add_argument (choices, type, ...).
    """
    metadata = {
        "help": help,
        "flags": flags,
        "env": env,
        "group": group,
        "parts": parts,
        "cli": cli,
        "argparse": argparse_options,
    }
    return dataclasses.field(default=default, metadata=metadata)


def default_of(field: dataclasses.Field):
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return None


def value_type(annotation):
    """int for `int` or `int | None`; None for str (argparse's own) and anything it cannot convert."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation if annotation in (int, float) else None


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def argument_group(parser: argparse.ArgumentParser, title: str, description: str):
    """The parser's --help section of that title, created on first use (settings of several classes share one)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)


def add_arguments(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Adds one flag per setting of the dataclass cls (see setting()); defaults: per-command defaults that replace
    the field's (e.g. the port of each role)."""
    defaults = defaults or {}
    for f in cli_fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        target = parser
        if meta["group"]:
            target = argument_group(parser, *meta["group"])
        if meta["parts"]:
            base = defaults.get(f.name, default_of(f))
            for part, (help_text, env) in meta["parts"].items():
                default = getattr(base, part)
                if env:
                    default = os.environ.get(env, default)
                    help_text = f"{help_text} (env {env})"
                target.add_argument(flag_name(f"{f.name}_{part}"), dest=f"{f.name}_{part}", default=default, help=help_text)
            continue
        default = defaults.get(f.name, default_of(f))
        help_text = meta["help"]
        if meta["env"]:
            default = os.environ.get(meta["env"], default)
            help_text = f"{help_text} (env {meta['env']})"
        elif default is not None and default is not False and default != "":
            help_text = f"{help_text} (default: %(default)s)"
        options = dict(meta["argparse"])
        if f.type is bool:
            options.setdefault("action", "store_true" if default is False else argparse.BooleanOptionalAction)
        elif value_type(f.type) and "choices" not in options:
            options.setdefault("type", value_type(f.type))
        flags = meta["flags"] or (flag_name(f.name),)
        if options.get("action") is None and "choices" not in options:
            options.setdefault("metavar", flags[0].removeprefix("--").replace("-", "_").upper())
        target.add_argument(*flags, dest=f.name, default=default, help=help_text, **options)


def from_arguments(args: argparse.Namespace, cls, **overrides):
    """An instance of the dataclass cls from parsed flags made by add_arguments; settings without a flag (or
    skipped) keep their defaults unless overrides gives them."""
    values = {}
    for f in cli_fields(cls):
        if f.metadata["parts"]:
            names = {part: f"{f.name}_{part}" for part in f.metadata["parts"]}
            if all(hasattr(args, name) for name in names.values()):
                values[f.name] = type(default_of(f))(**{part: getattr(args, name) for part, name in names.items()})
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**{**values, **overrides})


def check_token_given(token: str | None, name: str) -> None:
    """A token that is set but empty (an unset Secret's key, an empty variable) is a mistake, never "no auth"."""
    if token is not None and not token.strip():
        raise ConfigError(f"{name} is set but empty: give the token, or leave it unset for no authentication")


TLS_GROUP = ("TLS", "PEM files; a server given --tls-ca requires client certificates signed by it (mutual TLS)")


@dataclass
class ServerOptions:
    """What every specdec server is given: where it listens, TLS, shutdown and (workers) idle sessions."""

    port: int = setting(0, "port to listen on (0: any free port)")
    host: str = setting("0.0.0.0", "address to listen on")
    tls: TlsFiles = setting(
        TlsFiles(),
        group=TLS_GROUP,
        parts={
            "cert": ("this server's certificate", "SPECDEC_TLS_CERT"),
            "key": ("its private key", "SPECDEC_TLS_KEY"),
            "ca": ("CA that client certificates must chain to", "SPECDEC_TLS_CA"),
        },
    )
    unix_socket: str | None = setting(
        None,
        "also listen on this Unix socket (a path); a co-located coordinator reaches the service at unix:PATH without "
        "the TCP stack, a tenth of a millisecond less per round trip on loopback",
    )
    grace_period: float = setting(30.0, "on SIGTERM, seconds in-flight calls get to finish")
    session_idle_timeout: float = setting(600.0, "workers: close a session stream silent this long (s)")
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port (/metrics)")
    max_concurrent_rpcs: int | None = setting(
        1024, "calls a server runs at once (gRPC's maximum_concurrent_rpcs); more are refused RESOURCE_EXHAUSTED"
    )
    startup_lock: str = setting(
        default_lock_path(),
        "a file every specdec service on this machine shares while it starts (imports, loads) and a worker holds alone "
        "while it measures its cost curve, so that no curve measures another service's load (default: one per machine "
        "and user); 'none': no lock",
        env="SPECDEC_STARTUP_LOCK",
    )


@dataclass
class WorkerConfig:
    """A target worker's settings (a draft worker's add max_q_entries)."""

    model: str = setting(DEFAULT_TARGET_MODEL, "HF id or path, smollm2-135m, or tiny-random:...")
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = setting("auto", "auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    engine: str = setting(
        "auto",
        "gguf: compute on the GGUF file's own quantized blocks (CPU, AVX2); torch: the model de-quantised to float32 "
        "(bfloat16 on a GPU), equal to Hugging Face's generate; auto: gguf for a GGUF model on such a CPU, else torch",
        choices=["auto", "torch", "gguf"],
    )
    linear: str = setting(
        "auto",
        "torch engine: linear layers on weights packed once for oneDNN (auto: on a CPU with float32) or transformers' own",
        choices=["auto", "packed", "eager"],
    )
    max_sessions: int = setting(64, "most sessions held at once")
    max_prefill_tokens_per_pass: int = setting(
        256,
        "most prompt tokens prefilled in one pass, all opening sessions together; a longer prompt runs in chunks "
        "between the other sessions' rounds, each of which it then delays by one chunk at most",
    )
    prefix_cache_tokens: int = setting(
        16384,
        "KV-cache tokens of closed sessions kept for prompts that begin with their tokens (prefix caching; part of "
        "the KV budget, given back to openings that need it); 0 turns it off. Only where a runner computes every row "
        "alone (the gguf engine), so that a reused prefix holds the numbers a prefill would: exact",
    )
    max_kv_tokens: int | None = setting(
        None,
        "KV-cache tokens all sessions may reserve together, each its prompt + new + drafted tokens (default: what 80%% "
        "of the memory free after loading holds); an opening beyond it is RESOURCE_EXHAUSTED",
    )
    threads: int | None = setting(None, "compute threads (torch.set_num_threads); default: PyTorch's choice")
    cpus: str | None = setting(None, "pin the process to these CPUs, e.g. 0 or 0-3 or 0,2")
    worker_auth_token: str | None = setting(
        None,
        "require 'authorization: Bearer TOKEN' on every call but health checks and reflection (the coordinator's "
        "--worker-auth-token)",
        env="SPECDEC_WORKER_AUTH_TOKEN",
    )

    def __post_init__(self):
        check_token_given(self.worker_auth_token, "--worker-auth-token (SPECDEC_WORKER_AUTH_TOKEN)")
        if self.prefix_cache_tokens < 0:
            raise ConfigError(f"--prefix-cache-tokens must be at least 0, got {self.prefix_cache_tokens}")
        if self.max_prefill_tokens_per_pass < 1:
            raise ConfigError(f"--max-prefill-tokens-per-pass must be at least 1, got {self.max_prefill_tokens_per_pass}")


@dataclass
class DraftWorkerConfig(WorkerConfig):
    model: str = setting(
        DEFAULT_DRAFT_MODEL, "HF id or path, smollm2-135m, tiny-random:..., or ngram[:max=3,min=1] (prompt lookup)"
    )
    max_q_entries: int = setting(64, "most entries of each q (K) when the session does not say")

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.max_q_entries <= MAX_Q_ENTRIES:  # a target refuses a q beyond the protocol's limit
            raise ConfigError(f"--max-q-entries must be in [1, {MAX_Q_ENTRIES}], got {self.max_q_entries}")
