"""Who may start a request and how many run at once: one Admission per coordinator, shared by its gRPC and HTTP
APIs, so that --max-concurrent-requests and draining on SIGTERM hold for both together."""

import contextlib
from specdec.common.auth import token_matches
from specdec.common.errors import ResourceExhausted, Unauthenticated
from specdec.common.lifecycle import Lifecycle


class Admission:
    def __init__(self, max_concurrent_requests: int, auth_token: str | None = None):
        self.max_concurrent_requests = max_concurrent_requests
        self.auth_token = auth_token
        self.active = 0  # requests running, from either API
        self.lifecycle = Lifecycle(lambda: self.active)

    def authenticate(self, authorization: str | None, how: str) -> None:
        """authorization: the 'Bearer TOKEN' the caller presented; how: where the caller puts it, for the error."""
        if not self.auth_token:
            return
        if not token_matches(authorization, self.auth_token):
            raise Unauthenticated(f"authorization: send {how} with a valid token")

    @contextlib.contextmanager
    def slot(self):
        """Holds one of the coordinator's request slots; refuses while draining or full."""
        self.lifecycle.admit()
        if self.active >= self.max_concurrent_requests:
            raise ResourceExhausted(
                f"the coordinator is serving its maximum of {self.max_concurrent_requests} concurrent requests; retry later"
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
