"""The HTTP API's authentication: the bearer token, checked before a request's body is read."""

from specdec.common.errors import Unauthenticated
from specdec.coordinator.admission import Admission

from specdec.coordinator.http_errors import error_response


class AuthenticateFirst:
    """Checks the bearer token before the body is read: an unauthenticated client gets 401 without the coordinator
    reading (or describing the schema of) what it sent."""

    def __init__(self, app, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            presented = headers.get(b"authorization", b"").decode("latin-1")
            try:
                self.admission.authenticate(presented, "the header 'Authorization: Bearer <token>'")
            except Unauthenticated as error:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
