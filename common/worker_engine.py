"""What the target's and the draft's engines share: their sessions' registry (reserve, abandon, add, close) and the
shape of a batch (check every call, run those that passed, each call's result or error in its own place).
"""

from collections.abc import Callable
from typing import Generic, TypeVar

from specdec.common.errors import FailedPrecondition
from specdec.common.sessions import SessionRegistry
from specdec.common.worker_metrics import WorkerMetrics

S = TypeVar("S")  # a session: anything with a session_id


class WorkerEngine(Generic[S]):
    """A worker's sessions and batches; a subclass checks its calls (check_call), runs those that pass (run_ready)
    and frees what a closed session holds (closed)."""

    def __init__(self, role: str, sessions: SessionRegistry[S]):
        self.sessions = sessions
        self.metrics = WorkerMetrics(role, sessions)

    def reserve(self, kv_tokens: int, make: Callable[[str], S]) -> S:
        """Reserves a session (and kv_tokens of the KV budget) and makes it from its id; the reservation is released
        when the making fails."""
        session_id = self.sessions.reserve(kv_tokens)
        try:
            return make(session_id)
        except BaseException:
            self.sessions.release(session_id)
            raise

    def abandon(self, session: S) -> None:
        """Frees a session whose opening failed or was cancelled, prefilled or not."""
        self.sessions.release(session.session_id)

    def finish_opening(self, session: S) -> None:
        """Adds the prefilled session; FailedPrecondition when its reservation was released meanwhile."""
        if not self.sessions.add(session.session_id, session):
            raise FailedPrecondition("the opening was abandoned")

    def close_session(self, session: S) -> None:
        if self.sessions.remove(session.session_id):
            self.closed(session)

    def closed(self, session: S) -> None:
        """What a session just closed leaves behind (its caches), freed or kept."""

    def require_open(self, session: S) -> None:
        if session.session_id not in self.sessions.sessions:
            raise FailedPrecondition("the session is closed")

    def check_call(self, call) -> None:
        """Raises the error of a call that may not run."""
        raise NotImplementedError

    def run_batch(self, calls: list) -> list:
        """One result per call, in order: a call that fails its checks (check_call) gets its error, and run_ready
        fills in those of the calls that passed, if any."""
        results: list = [None] * len(calls)
        ready = []
        for i, call in enumerate(calls):
            try:
                self.check_call(call)
                ready.append(i)
            except Exception as error:  # noqa: BLE001 - one bad message fails its own stream only
                results[i] = error
        if ready:
            self.run_ready(calls, ready, results)
        return results

    def run_ready(self, calls: list, ready: list[int], results: list) -> None:
        """Runs the calls that passed their checks (by their indices in ready), each one's result into results."""
        raise NotImplementedError
