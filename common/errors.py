"""Errors the engines raise; the servicers map each to a gRPC status code (the engines know nothing of gRPC)."""


class SpecdecError(Exception):
    """Base of the errors a request can fail with."""


class InvalidArgument(SpecdecError):
    """A request field has a value the service cannot use. The message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class ResourceExhausted(SpecdecError):
    """A capacity limit (sessions, concurrent requests) is reached; retrying later can succeed."""


class Unavailable(SpecdecError):
    """A service this one depends on cannot be reached or failed."""


class FailedPrecondition(SpecdecError):
    """The request does not fit the state of its session, e.g. a step before the session was opened."""


class DeadlineExceeded(SpecdecError):
    """A time limit passed: an idle session was reclaimed, or a request ran out of time."""


class Unauthenticated(SpecdecError):
    """The call carried no valid credentials."""


class WorkerFailed(SpecdecError):
    """A worker answered with an error of its own (a bug, not a fault of the request or of the network)."""
