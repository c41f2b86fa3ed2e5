"""The coordinator's settings and their defaults; `specdec serve coordinator` derives its flags from them
(common.config.add_arguments)."""

from dataclasses import dataclass

from common.config import TLS_GROUP, DraftWorkerConfig, setting
from common.tls import TlsFiles


@dataclass
class CoordinatorConfig:
    """The engine's settings: speculation, limits of a request, deadlines of the workers."""

    default_num_speculative_tokens: int | None = setting(
        None,
        "default gamma; -1 (the default with a draft) chooses it each round, 0 (the default without) turns speculation off",
        flags=("--num-speculative-tokens", "--gamma"),
    )
    max_num_speculative_tokens: int = setting(16, "largest gamma a request may ask")
    default_max_new_tokens: int = setting(256, "max_new_tokens of a request that does not say")
    max_new_tokens_cap: int = setting(4096, "largest max_new_tokens a request may ask")
    # K of the draft's q; the same default as the draft worker's own, which applies when a session does not say.
    max_q_entries: int = setting(DraftWorkerConfig.max_q_entries, cli=False)
    num_p_entries: int = setting(0, "top entries of p the target returns per position")
    server_address: str = setting("localhost", cli=False)  # set by the server once it listens
    server_port: int = setting(0, cli=False)
    draft_timeout: float = setting(2.0, "per-round deadline of the draft worker (s); missing it turns speculation off")
    target_timeout: float = setting(60.0, "per-round deadline of the target worker (s)")
    target_retry_window: float = setting(30.0, "how long a request keeps reopening a failed target session (s)")
    max_target_retries: int = setting(
        10, "most reopenings of a failed target session per request, and most tries of each reopening", cli=False
    )
    max_draft_reopens: int = setting(3, "most reopenings of a failed draft session per request", cli=False)
    overlap: bool = setting(
        False,
        "by default, draft round n+1 while the target verifies round n (pays when the workers run on separate devices or cores)",
    )


@dataclass
class CoordinatorServerConfig:
    """The coordinator process's settings beyond the engine's: its workers, tokenizer and admission."""

    target: list[str] | None = setting(
        None,
        "target workers: host:port or unix:PATH, several (repeat the flag or separate by commas), or one "
        "dns:///name:port re-resolved periodically, e.g. a Kubernetes headless Service (required)",
        action="append",
    )
    draft: list[str] | None = setting(None, "draft workers, given as --target is (omit to run target-only)", action="append")
    tokenizer: str | None = setting(None, "tokenizer spec (default: the target worker's model)")
    http_port: int | None = setting(
        None, "also serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) on this port"
    )
    max_concurrent_requests: int = setting(256, "more get RESOURCE_EXHAUSTED")
    auth_token: str | None = setting(None, "require 'authorization: Bearer TOKEN'", env="SPECDEC_AUTH_TOKEN")
    worker_tls: TlsFiles = setting(
        TlsFiles(),
        group=TLS_GROUP,
        parts={
            "cert": ("client certificate for the workers", "SPECDEC_WORKER_TLS_CERT"),
            "key": ("its private key", "SPECDEC_WORKER_TLS_KEY"),
            "ca": ("CA of the workers' certificates", "SPECDEC_WORKER_TLS_CA"),
        },
    )
    startup_timeout: float = setting(600.0, "seconds to wait for a target worker to report SERVING")
    draft_startup_timeout: float = setting(
        15.0, "seconds to wait at start-up for a draft worker, after which the coordinator serves target-only until one is up"
    )


@dataclass
class PoolSettings:
    """How the coordinator watches its worker pools (coordinator.pool)."""

    poll_interval: float = setting(1.0, "seconds between two health and session-count polls of each worker")
    resolve_interval: float = setting(5.0, "seconds between two resolutions of a dns:/// worker address")
    poll_timeout: float = setting(2.0, "seconds a worker gets to answer a poll before it counts as unreachable")
    first_answer_timeout: float = setting(10.0, "seconds to wait for a serving worker when a pool is first asked", cli=False)
    retry_initial: float = setting(
        0.5, "first pause before a worker whose session failed gets sessions again, doubling (s)", cli=False
    )
    retry_max: float = setting(30.0, "longest such pause (s)", cli=False)
