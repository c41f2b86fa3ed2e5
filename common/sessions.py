"""The sessions a worker holds: one per open stream, bounded in number."""

import itertools
import os
import threading
import time
from typing import Generic, TypeVar

from common.errors import ResourceExhausted

S = TypeVar("S")


class SessionRegistry(Generic[S]):
    """Thread-safe: sessions are reserved on the event loop and added by the compute thread after their prefill."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.sessions: dict[str, S] = {}
        self.reserved: set[str] = set()  # ids whose prefill is pending
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"

    def reserve(self) -> str:
        """A new session id, or ResourceExhausted when full (pending prefills count): checked before the prefill."""
        with self._lock:
            if len(self.sessions) + len(self.reserved) >= self.max_sessions:
                raise ResourceExhausted(f"worker holds its maximum of {self.max_sessions} sessions; retry later")
            session_id = f"{self._prefix}-{next(self._ids)}"
            self.reserved.add(session_id)
            return session_id

    def add(self, session_id: str, session: S) -> bool:
        """Adds a reserved session; False (and nothing added) when its reservation was released meanwhile."""
        with self._lock:
            if session_id not in self.reserved:
                return False
            self.reserved.discard(session_id)
            self.sessions[session_id] = session
            return True

    def release(self, session_id: str) -> None:
        """Gives up a reservation or a session, whichever the id holds."""
        with self._lock:
            self.reserved.discard(session_id)
            self.sessions.pop(session_id, None)

    def remove(self, session_id: str) -> None:
        self.release(session_id)

    def __len__(self) -> int:
        return len(self.sessions)

    def recently_active(self, seconds: float) -> int:
        """Sessions that stepped within the last `seconds` (each session has a last_active monotonic time)."""
        since = time.monotonic() - seconds
        # list() copies the values in one step: the compute thread may add a session meanwhile.
        return sum(1 for session in list(self.sessions.values()) if session.last_active >= since)
