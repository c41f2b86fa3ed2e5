"""The sessions a worker holds: one per open stream, bounded in number."""

import itertools
import os
import time
from typing import Generic, TypeVar

from common.errors import ResourceExhausted

S = TypeVar("S")


class SessionRegistry(Generic[S]):
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.sessions: dict[str, S] = {}
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"

    def reserve(self) -> str:
        """A new session id, or ResourceExhausted when full: checked before the (costly) prefill. Opening runs on
        the worker's single compute thread, so nothing can take the slot between reserve and add."""
        if len(self.sessions) >= self.max_sessions:
            raise ResourceExhausted(f"worker holds its maximum of {self.max_sessions} sessions; retry later")
        return f"{self._prefix}-{next(self._ids)}"

    def add(self, session_id: str, session: S) -> None:
        self.sessions[session_id] = session

    def remove(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self.sessions)

    def recently_active(self, seconds: float) -> int:
        """Sessions that stepped within the last `seconds` (each session has a last_active monotonic time)."""
        since = time.monotonic() - seconds
        # list() copies the values in one step: the compute thread may add a session meanwhile.
        return sum(1 for session in list(self.sessions.values()) if session.last_active >= since)
