"""The OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions and POST /v1/chat/completions, beside
GenerationService in the coordinator's event loop (FastAPI on uvicorn).

A thin translation, as coordinator.server is for gRPC: an OpenAI request becomes a GenerateRequest and goes through
the same checks (coordinator.requests.params_of), the same admission and the same engine; the result comes back in
OpenAI's shapes, with `usage` and specdec's per-request `speculation` figures. specdec's own knobs are extra body
fields (the openai SDK's `extra_body`): top_k, num_speculative_tokens, overlap, ignore_eos,
speculation_by_position for acceptance per draft position, and grammar (Lark or GBNF) to constrain the output.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from specdec.common.grpc_options import MAX_MESSAGE_BYTES
from specdec.coordinator.admission import Admission
from specdec.coordinator.config import HttpSettings
from specdec.coordinator.engine import GenerationEngine
from specdec.coordinator.http_auth import AuthenticateFirst
from specdec.coordinator.http_completions import CompletionHandler
from specdec.coordinator.http_errors import invalid_body
from specdec.coordinator.http_schema import ChatCompletionRequest, CompletionRequest
from specdec.coordinator.http_server import HttpServer, start_http

# The app is built here and served by coordinator.http_server; the rest of the API, by job: http_schema (the
# request bodies), http_translate (to the engine's request), http_completions (the endpoints' work), http_responses
# (OpenAI's shapes), http_streaming (server-sent events), http_errors (every error, from one table), http_auth.
__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "HttpServer", "build_app", "start_http"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the coordinator's


def build_app(engine: GenerationEngine, admission: Admission, http: HttpSettings | None = None) -> FastAPI:
    app = FastAPI(
        title="specdec",
        summary="OpenAI-compatible API over speculative decoding",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        max_body_size=MAX_MESSAGE_BYTES,  # the gRPC API's message limit
        # The HTTP server span, continuing the caller's traceparent, from the providers this process set up
        # (common.telemetry); no providers or exporters of FastAPI's own, no span per endpoint function.
        telemetry={"auto_configure": False, "operation_spans": False},
    )
    app.add_middleware(AuthenticateFirst, admission=admission)
    app.add_exception_handler(RequestValidationError, invalid_body)
    add_routes(app, engine, CompletionHandler(engine, admission, http or HttpSettings()))
    return app


def add_routes(app: FastAPI, engine: GenerationEngine, handler: CompletionHandler) -> None:
    @app.get("/v1/models")
    async def models():
        model = {"id": engine.target.model_name, "object": "model", "created": 0, "owned_by": "specdec"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await handler.complete(request, body, chat=False, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await handler.complete(request, body, chat=True, default_max_tokens=None)
