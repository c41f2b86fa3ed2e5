"""Every error the HTTP API answers with, in OpenAI's error shape. Its status and type come from one table:
common.errors.ERROR_STATUS (the rule gRPC's statuses follow too) with the few errors only HTTP tells
(HTTP_ERROR_STATUS); its headers come from its status. Nothing else builds an error response."""

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from specdec.common.errors import ERROR_STATUS, ErrorStatus, InvalidArgument, SpecdecError, classified
from specdec.coordinator.http_schema import RequestFields
from specdec.coordinator.http_translate import param_of


class HttpError(SpecdecError):
    """An error only the HTTP API tells, with the OpenAI `param` and `code` it names."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ModelNotFound(HttpError):
    """A request for a model this deployment does not serve."""

    def __init__(self, model: str, served: str):
        message = f"The model '{model}' does not exist; this deployment serves '{served}'"
        super().__init__(message, "model", "model_not_found")


class InvalidBody(HttpError):
    """A body that does not fit the schema, naming its first bad parameter (None: not a parameter's fault)."""

    def __init__(self, param: str | None, problem: str):
        super().__init__(f"{param or 'body'}: {problem}", param)


class ClientClosed(HttpError):
    """The client went away before its (non-streamed) request ended."""

    def __init__(self):
        super().__init__("client closed the request")


HTTP_ERROR_STATUS = {
    **ERROR_STATUS,
    InvalidBody: ErrorStatus("INVALID_ARGUMENT", 400, "invalid_request_error"),
    ModelNotFound: ErrorStatus("NOT_FOUND", 404, "invalid_request_error"),
    ClientClosed: ErrorStatus("CANCELLED", 499, "client_closed_request"),  # nginx's status, which nobody reads
}


def status_of(error: Exception) -> tuple[ErrorStatus, str]:
    """(status, message) of an error, from HTTP_ERROR_STATUS; anything unexpected is common.errors.classified's
    internal error (its detail logged)."""
    status = HTTP_ERROR_STATUS.get(type(error))
    if status is None:
        return classified(error)
    return status, str(error) or type(error).__name__


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_event(error: Exception) -> dict:
    """An error after a stream began, as its last event's payload (the status line is gone by then)."""
    error_status, message = status_of(error)
    return error_body(message, error_status.openai_type)


def error_response(error: Exception, body: RequestFields | None = None, admitted: bool = False) -> JSONResponse:
    """An error in OpenAI's error shape with the matching status; anything unexpected is a logged 500.

    admitted: the request ran, and the coordinator already spent its own retries on the workers: the openai SDK is
    told not to retry it (it honours x-should-retry). A refusal at admission while draining closes the connection,
    so that a retry goes out on a new one, which a load balancer may send to another coordinator."""
    error_status, message = status_of(error)
    status, kind = error_status.http_status, error_status.openai_type
    param = code = None
    if isinstance(error, HttpError):
        param, code = error.param, error.code
    elif isinstance(error, InvalidArgument):
        # The check names the engine's field; the caller is told the name it sent (max_tokens, not max_new_tokens).
        param = param_of(error.field, body)
        if param != error.field and message.startswith(f"{error.field}:"):
            message = param + message[len(error.field) :]
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers_of(status, admitted))


def headers_of(status: int, admitted: bool) -> dict:
    """The headers an error response with this status carries: how to authenticate, when to retry."""
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif status == 429:
        headers["Retry-After"] = "1"
    elif status >= 500:
        headers["x-should-retry"] = "false" if admitted else "true"
        if not admitted:
            headers["Connection"] = "close"
    return headers


def param_from_location(location: tuple) -> str | None:
    """The field a body validation error is about, without pydantic's union member tags (e.g. 'stop.str')."""
    parts = [part for part in location[1:] if isinstance(part, int) or ("[" not in part and part not in TYPE_TAGS)]
    if not parts or isinstance(parts[0], int):  # malformed JSON: the location is a byte offset
        return None
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body that does not fit the schema: 400, naming its first bad parameter."""
    first = error.errors()[0]
    return error_response(InvalidBody(param_from_location(first["loc"]), first["msg"]))
