"""The sessions a worker holds: one per open stream, bounded in number and in the KV-cache tokens they reserve."""

import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Generic, TypeVar

from specdec.common.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from specdec.common.prefix_cache import PrefixCache

S = TypeVar("S")


class SessionRegistry(Generic[S]):
    """Thread-safe: sessions are reserved on the event loop and added by the compute thread after their prefill.

    Each session reserves, at its opening, the most tokens it will hold (prompt, generated and drafted tokens);
    the reservations together never exceed max_kv_tokens, so the caches that grow into them always fit in the
    memory the budget was derived from (admission by KV tokens, as vLLM and TGI admit, not by session count alone).
    Closed sessions' caches kept for reuse (common.prefix_cache) hold part of the budget until an opening needs it.
    """

    def __init__(self, max_sessions: int, max_kv_tokens: int | None = None, spare: "PrefixCache | None" = None):
        self.max_sessions = max_sessions
        self.max_kv_tokens = max_kv_tokens  # None: no budget (a model-free proposer with nothing to cache)
        self.spare = spare  # what it holds is taken back, least recently used first, for the reservations
        if spare is not None:
            spare.room = self.unreserved_kv_tokens
        self.sessions: dict[str, S] = {}
        self.reserved: set[str] = set()  # ids whose prefill is pending
        self.kv_tokens: dict[str, int] = {}  # per session (pending or open): the tokens it reserved
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"

    @property
    def reserved_kv_tokens(self) -> int:
        return sum(self.kv_tokens.values())

    def reserve(self, kv_tokens: int = 0) -> str:
        """A new session id holding kv_tokens of the budget, or ResourceExhausted when the sessions (pending
        prefills count) or the budget are full: checked before the prefill."""
        budget = self.max_kv_tokens
        if budget is not None and kv_tokens > budget:
            raise ResourceExhausted(
                f"the session needs {kv_tokens} KV tokens (start.max_tokens), more than this worker's whole budget "
                f"of {budget} (--max-kv-tokens): it can never fit here; ask for fewer tokens"
            )
        with self._lock:
            if len(self.sessions) + len(self.reserved) >= self.max_sessions:
                raise ResourceExhausted(f"worker holds its maximum of {self.max_sessions} sessions; retry later")
            reserved = sum(self.kv_tokens.values())
            if budget is not None and reserved + kv_tokens > budget:
                raise ResourceExhausted(
                    f"the session needs {kv_tokens} KV tokens and {budget - reserved} of this worker's {budget} are "
                    "free; retry later"
                )
            if budget is not None and self.spare is not None:
                # Only for an opening that fits: one refused anyway must not empty the cache for nothing.
                short = reserved + self.spare.held + kv_tokens - budget
                if short > 0:
                    self.spare.release(short)
            session_id = f"{self._prefix}-{next(self._ids)}"
            self.reserved.add(session_id)
            self.kv_tokens[session_id] = kv_tokens
            return session_id

    def unreserved_kv_tokens(self) -> int | None:
        """The budget's tokens no session reserves (None: no budget), kept caches' or free."""
        with self._lock:
            return None if self.max_kv_tokens is None else self.max_kv_tokens - sum(self.kv_tokens.values())

    def add(self, session_id: str, session: S) -> bool:
        """Adds a reserved session; False (and nothing added) when its reservation was released meanwhile."""
        with self._lock:
            if session_id not in self.reserved:
                return False
            self.reserved.discard(session_id)
            self.sessions[session_id] = session
            return True

    def release(self, session_id: str) -> bool:
        """Gives up a reservation or a session, whichever the id holds; True when it held a session."""
        with self._lock:
            self.reserved.discard(session_id)
            self.kv_tokens.pop(session_id, None)
            return self.sessions.pop(session_id, None) is not None

    def remove(self, session_id: str) -> bool:
        """Closes a session; True the first time (a session is closed once, whoever asks first)."""
        return self.release(session_id)

    def __len__(self) -> int:
        return len(self.sessions)

    def recently_active(self, seconds: float) -> int:
        """Sessions that stepped within the last `seconds` (each session has a last_active monotonic time)."""
        since = time.monotonic() - seconds
        # list() copies the values in one step: the compute thread may add a session meanwhile.
        return sum(1 for session in list(self.sessions.values()) if session.last_active >= since)


# What a session of a model that states no context length may hold.
UNSTATED_CONTEXT = 32_768


def session_reservation(max_tokens: int, prompt_tokens: int, context: int) -> int:
    """The KV tokens a session opening reserves: what its start asked (start.max_tokens), at most the model's
    context; 0 asks for the whole context. It must leave room for a token after the prompt."""
    if max_tokens < 0:
        raise InvalidArgument("start.max_tokens", f"must be >= 0, got {max_tokens}")
    context = context or UNSTATED_CONTEXT
    reservation = min(max_tokens or context, context)
    if reservation <= prompt_tokens:
        raise InvalidArgument("start.max_tokens", f"{reservation} tokens leave no room after the prompt's {prompt_tokens}")
    return reservation
