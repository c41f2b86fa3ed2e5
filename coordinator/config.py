"""The coordinator's settings and their defaults; `specdec serve coordinator` derives its flags from them
(common.config.add_arguments)."""

from dataclasses import dataclass

from specdec.common.config import TLS_GROUP, ConfigError, DraftWorkerConfig, check_token_given, setting
from specdec.common.tls import TlsFiles
from specdec.common.wire_limits import MAX_P_ENTRIES, MAX_STEP_TOKENS
from specdec.draft_worker.specs import is_model_free


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
    max_prompt_chars: int = setting(
        1 << 20, "longest prompt text (of all chat messages together) accepted, checked before tokenizing (characters)"
    )
    # K of the draft's q; the same default as the draft worker's own, which applies when a session does not say.
    max_q_entries: int = setting(DraftWorkerConfig.max_q_entries, cli=False)
    num_p_entries: int = setting(0, "top entries of p the target returns per position")
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
    decode_ahead: bool = setting(
        True,
        "where the next round is not expected to draft, the target scores its first token as soon as it is known, "
        "while the verdict and the next step are on the wire (a target that reports decodes_ahead)",
    )

    def __post_init__(self):
        # The workers refuse a step beyond the protocol's limits: a coordinator that would send one fails at start.
        if not 0 <= self.max_num_speculative_tokens <= MAX_STEP_TOKENS:
            raise ConfigError(
                f"--max-num-speculative-tokens must be in [0, {MAX_STEP_TOKENS}], got {self.max_num_speculative_tokens}"
            )
        if not 0 <= self.num_p_entries <= MAX_P_ENTRIES:
            raise ConfigError(f"--num-p-entries must be in [0, {MAX_P_ENTRIES}], got {self.num_p_entries}")


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
    local_draft: str | None = setting(
        None,
        "a model-free draft run in this process instead of draft workers: ngram[:...] (prompt lookup) or suffix[:...] "
        "(suffix trees); no exchange with a draft worker per round",
    )
    model_free_draft_here: bool = setting(
        False,
        "when the draft workers (--draft) serve a model-free draft (ngram or suffix), run that same draft in this "
        "process, as --local-draft does; a model draft stays on the workers (for deployments whose draft is chosen "
        "on the draft workers, e.g. compose and Kubernetes)",
    )
    tokenizer: str | None = setting(None, "tokenizer spec (default: the target worker's model)")
    http_port: int | None = setting(
        None, "also serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) on this port"
    )
    max_concurrent_requests: int = setting(256, "more get RESOURCE_EXHAUSTED")
    auth: str = setting(
        "auto",
        "token: require --auth-token from clients, refusing to start without one; none: no authentication; auto: token "
        "when one is given",
        env="SPECDEC_AUTH",
        choices=["auto", "token", "none"],
    )
    auth_token: str | None = setting(None, "require 'authorization: Bearer TOKEN'", env="SPECDEC_AUTH_TOKEN")
    worker_auth_token: str | None = setting(
        None,
        "send 'authorization: Bearer TOKEN' on every call to the workers (their --worker-auth-token)",
        env="SPECDEC_WORKER_AUTH_TOKEN",
    )
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

    def __post_init__(self):
        # Fail closed: a configured but missing token never means "no authentication".
        check_token_given(self.auth_token, "--auth-token (SPECDEC_AUTH_TOKEN)")
        check_token_given(self.worker_auth_token, "--worker-auth-token (SPECDEC_WORKER_AUTH_TOKEN)")
        if self.auth == "token" and not self.auth_token:
            raise ConfigError("--auth token (SPECDEC_AUTH) requires --auth-token (SPECDEC_AUTH_TOKEN); none was given")
        if self.local_draft is not None:
            if self.draft:
                raise ConfigError("--local-draft and --draft exclude each other: the draft runs here or on draft workers")
            if not is_model_free(self.local_draft):
                raise ConfigError(
                    f"--local-draft takes a model-free draft (ngram[:...] or suffix[:...]), got {self.local_draft!r}; "
                    "a model draft runs on draft workers (--draft)"
                )
        if self.model_free_draft_here and not self.draft:
            raise ConfigError("--model-free-draft-here takes draft workers (--draft) whose draft it would run here")
        if self.auth == "none" and self.auth_token:
            raise ConfigError("--auth none (SPECDEC_AUTH) contradicts the --auth-token given; drop one of them")


HTTP_GROUP = ("HTTP API", "limits of the OpenAI-compatible API (--http-port), against slow and silent clients")


@dataclass
class HttpSettings:
    """What bounds an HTTP client: the time its request may take, how long it may stall, how many it may hold."""

    http_request_timeout: float = setting(600.0, "an HTTP request's overall deadline (s); past it: 504", group=HTTP_GROUP)
    http_stall_timeout: float = setting(
        30.0, "a stream whose client reads nothing for this long is cancelled and its sessions freed (s)", group=HTTP_GROUP
    )
    http_header_timeout: float = setting(10.0, "seconds a connection gets to send a request's headers", group=HTTP_GROUP)
    http_keep_alive: int = setting(5, "seconds an idle connection is kept open", group=HTTP_GROUP)
    http_max_connections: int = setting(
        1024, "connections and requests uvicorn holds at once (its limit_concurrency); more get 503", group=HTTP_GROUP
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
