"""The router's OpenAI-compatible HTTP front door (FastAPI on uvicorn): the app, its
routes, error handlers and middleware. Each endpoint is a module of its own over
``http.endpoint``.

Routes: ``POST /v1/completions`` (``http.completions``), ``POST /v1/chat/completions``
(``http.chat``; both streamed as SSE ``data: {json}`` events ending with ``data:
[DONE]``, or whole), ``POST /v1/responses`` and ``GET`` / ``DELETE
/v1/responses/{id}`` (``http.responses``), ``POST /tokenize`` and ``/detokenize``
(``http.tokenize``), ``GET /tokenizer_info``, ``GET /v1/models``, ``GET /health``
(200 only while ``router.ready()``), ``GET /metrics`` (the registry in Prometheus text
format), ``GET /openapi.json`` (the request bodies as ``http.openapi_doc`` describes
them), and with an ``Admin`` the operator's ``/admin/`` routes (``http.admin``). With
API keys, every route but the two probes needs ``Authorization: Bearer <key>``
(``http.middleware.ApiKeyMiddleware``).

Errors are OpenAI error objects with the status of
``openai.response_objects.ERROR_STATUS``; bad input is a 4xx, never a 500: a body that
is not ``application/json`` is a 415 (a browser can send ``text/plain`` cross-origin
without asking), one that nests too deep, is not JSON or holds a lone surrogate a 400
(``http.json_body``), one too large a 413 (``http.middleware``). Messages are what
``api.public_errors`` lets a client see. Output constraints (structured outputs,
forced tool calls) are compiled before the request runs
(``openai.sampling_fields.check_grammars``: a 400 naming the field, bounded in time).

``n`` > 1: ``n`` router requests of the same prompt
(``openai.sampling_fields.choice_requests``) read as one (``http.choices.Choices``),
the others started once the first has its first token so that they reuse its
prompt's KV through the prefix cache; the response merges them, a stream interleaves
their chunks by choice index, and one failing fails the request and cancels the
others. A completions batch of prompts is the same with ``n`` choices per prompt,
choice ``p * n + i``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.api.common import RouterLike, served_model
from pdserve.router.api.keys import ApiKeys
from pdserve.router.http import openapi_doc
from pdserve.router.http.admin import Admin, admin_routes
from pdserve.router.http.chat import Chat
from pdserve.router.http.completions import Completions
from pdserve.router.http.endpoint import Served
from pdserve.router.http.middleware import (
    BODY_TIMEOUT_S,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from pdserve.router.http.request import ApiError, ClientGone
from pdserve.router.http.responses import Responses
from pdserve.router.http.server import HttpServer, start_http_server
from pdserve.router.http.tokenize import Tokenize
from pdserve.router.metrics import metrics_text
from pdserve.router.openai.response_objects import error_object, router_error_object
from pdserve.router.types import ErrorKind, ModelInfo, RouterError

log = logging.getLogger("pdserve.http")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
__all__ = ["DEFAULT_MAX_BODY_BYTES", "HttpServer", "build_app", "start_http_server"]


def build_app(router: RouterLike, model_name: str, registry: CollectorRegistry,
              api_keys: ApiKeys | None = None, protect_probes: bool = False,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, admin: Admin | None = None,
              body_timeout_s: float = BODY_TIMEOUT_S,
              targets: Callable[[tuple[str, int]], list[dict[str, Any]]] | None = None,
              ) -> FastAPI:
    """The ASGI app serving ``router`` as ``model_name``; see the module docstring.
    ``api_keys``: None = open; ``protect_probes``: the keys guard ``/health`` and
    ``/metrics`` too; ``admin``: serve ``/admin/`` (``http.admin``) over it;
    ``targets``: serve ``/metrics/targets``, Prometheus HTTP service discovery (the
    deployment's ``/metrics`` endpoints, given where the scraper reached this one)."""
    served = Served(router, model_name)
    chat = Chat(served)
    completion_endpoint, responses_endpoint = Completions(served), Responses(chat, registry)
    tokenizer = Tokenize(served)

    # Each route is a function of its own: FastAPI names its OpenAPI operation after it.
    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await completion_endpoint.handle(request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.handle(request)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        return await responses_endpoint.handle(request)

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return responses_endpoint.kept(response_id, forget=False)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses_endpoint.kept(response_id, forget=True)

    def model_object(m: ModelInfo) -> dict[str, Any]:
        return {"id": m.id, "object": "model", "created": 0, "owned_by": m.owned_by,
                "max_model_len": m.max_model_len}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object(m) for m in router.models()]}

    @v1.get("/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """The openai SDK's ``models.retrieve``: one served model, or a 404."""
        try:
            return JSONResponse(model_object(served_model(router, model_id)))
        except RouterError as exc:
            raise ApiError.from_router(exc, request.state.request_id) from exc

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.include_router(v1)
    if admin is not None:
        app.include_router(admin_routes(admin))
    app.state.pdserve_api = served  # for HttpServer.stop(): begin_shutdown(), tasks

    # vLLM's tokenizer endpoints (outside /v1, as vLLM serves them)
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenizer.tokenize(request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await tokenizer.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return router.tokenizer.info()

    @app.get("/health")
    async def health(request: Request) -> Response:
        if router.ready():
            return JSONResponse({"status": "ok"})
        status, body = router_error_object(RouterError(ErrorKind.NOT_READY,
                                                       "no live prefill/decode worker pair"),
                                           request.state.request_id)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(registry), media_type=CONTENT_TYPE_LATEST)

    if targets is not None:
        discover = targets

        @app.get("/metrics/targets")
        async def metrics_targets(request: Request) -> Response:
            here = (request.url.hostname or "127.0.0.1",
                    request.url.port or (443 if request.url.scheme == "https" else 80))
            return JSONResponse(discover(here))

    openapi_doc.install(app, [m.id for m in router.models()], api_keys is not None,
                        protect_probes)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        log.info("request %s: client disconnected", request.state.request_id)
        return Response(status_code=499)  # nobody reads it

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return JSONResponse(error_object(str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("request %s failed", request.state.request_id, exc_info=exc)
        return JSONResponse(error_object("internal error", "server_error"), status_code=500)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
    # Added last = outermost: request id, then the body limit, then the keys (the
    # body is read before a 401, so that answering never resets the connection).
    if api_keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys, protect_probes=protect_probes)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)
    app.add_middleware(RequestIdMiddleware)
    return app
