"""Errors the engines raise, and the one rule for what a caller is told of each: its gRPC status code, its HTTP
status and its OpenAI error type (ERROR_STATUS). The engines know nothing of gRPC or HTTP: the gRPC servicers
(common.grpc_errors) and the HTTP API (coordinator.http_errors) both read the rule here."""

import logging
import uuid
from dataclasses import dataclass

log = logging.getLogger("specdec")


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


@dataclass(frozen=True)
class ErrorStatus:
    """What an error is told as: grpc_code names a grpc.StatusCode; http_status and openai_type are the OpenAI
    API's status and error type."""

    grpc_code: str
    http_status: int
    openai_type: str


ERROR_STATUS = {
    InvalidArgument: ErrorStatus("INVALID_ARGUMENT", 400, "invalid_request_error"),
    FailedPrecondition: ErrorStatus("FAILED_PRECONDITION", 400, "invalid_request_error"),
    Unauthenticated: ErrorStatus("UNAUTHENTICATED", 401, "authentication_error"),
    ResourceExhausted: ErrorStatus("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
    # A worker's own error: what it told (its own incident id) is passed on.
    WorkerFailed: ErrorStatus("INTERNAL", 502, "worker_error"),
    Unavailable: ErrorStatus("UNAVAILABLE", 503, "service_unavailable_error"),
    DeadlineExceeded: ErrorStatus("DEADLINE_EXCEEDED", 504, "timeout_error"),
}
# Anything else (a bug, a library's exception) is an internal error, told without its detail.
INTERNAL_ERROR = ErrorStatus("INTERNAL", 500, "internal_error")


def internal_error_message(error: BaseException) -> str:
    """What a caller is told of an unexpected error: a fixed text and an incident id; the detail (an exception's
    text, which may quote a library's internals or another session's data) goes to the log under that id."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error, incident %s", incident, exc_info=error)
    return f"internal error (incident {incident}: details in the server's log)"


def classified(error: Exception) -> tuple[ErrorStatus, str]:
    """(status, message) of an error a request failed with: an engine error's own text, or for anything
    unexpected INTERNAL_ERROR and internal_error_message (the detail is logged)."""
    status = ERROR_STATUS.get(type(error))
    if status is None:
        return INTERNAL_ERROR, internal_error_message(error)
    return status, str(error) or type(error).__name__
