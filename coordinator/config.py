"""The coordinator's settings and their defaults."""

from dataclasses import dataclass


@dataclass
class CoordinatorConfig:
    default_num_speculative_tokens: int | None = None  # None: auto (-1) with a draft worker, 0 without
    max_num_speculative_tokens: int = 16
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    max_q_entries: int = 64
    num_p_entries: int = 0
    server_address: str = "localhost"
    server_port: int = 0
    draft_timeout: float = 2.0  # per-round deadline of the draft worker; missing it turns speculation off
    draft_retry_initial: float = 0.5  # first pause before a failed draft worker is tried again, doubling
    draft_retry_max: float = 30.0
    target_timeout: float = 60.0  # per-round deadline of the target worker
    target_retry_window: float = 30.0  # how long a request keeps reopening a failed target session
    max_target_retries: int = 10
    overlap: bool = False  # default of GenerateRequest.overlap
