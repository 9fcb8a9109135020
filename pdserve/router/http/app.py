"""The router's OpenAI-compatible HTTP front door (FastAPI on uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE
``data: {json}`` events ending with ``data: [DONE]``, or whole), ``POST
/v1/responses`` (served as the chat body it maps to, answered in the Responses API's
shapes and typed events: ``openai.responses_api``; ``GET`` / ``DELETE
/v1/responses/{id}`` for the ones kept), ``GET /v1/models``,
``GET /health`` (200 only while ``router.ready()``), ``GET /metrics`` (the
registry in Prometheus text format), ``GET /openapi.json`` (the request bodies as
``http.openapi_doc`` describes them), and with an ``Admin`` the operator's ``/admin/``
routes (``http.admin``). With API keys, every route but the two probes
needs ``Authorization: Bearer <key>`` (``http.middleware.ApiKeyMiddleware``).

Errors are OpenAI error objects with the status of ``openai.response_objects.ERROR_STATUS``;
bad input is a 4xx, never a 500: a body that is not ``application/json`` is a
415 (a browser can send ``text/plain`` cross-origin without asking), one that
nests too deep, is not JSON or holds a lone surrogate a 400 (``http.json_body``), one
too large a 413 (``http.middleware``). Messages are what ``api.public_errors`` lets a
client see. A request's first stream item is awaited before the response starts,
so admission failures (429 with ``Retry-After``, 400s from the router) keep their
status even when streaming; a router error after that becomes an SSE error event
followed by ``[DONE]``. Output constraints (structured outputs, forced tool calls) are
compiled before the request runs (``openai.request_mapping.check_grammars``: a 400 naming the
field, bounded in time).

``n`` > 1: ``n`` router requests of the same prompt (``openai.request_mapping.choice_requests``)
read as one (``Choices``), the others started once the first has its first token so
that they reuse its prompt's KV through the prefix cache; the response merges them, a
stream interleaves their chunks by choice index, and one failing fails the request and
cancels the others. A completions batch of prompts is the same with ``n`` choices per
prompt, choice ``p * n + i``.

Cancellation: a client that goes away, before or during the response, closes its
``RouterStream``s (one per choice), which abort the request on both workers (see
``api.router_stream``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.api.beam_search import beam_search
from pdserve.router.api.common import RouterLike, check_model, served_model
from pdserve.router.api.keys import ApiKeys
from pdserve.router.http import openapi_doc
from pdserve.router.http.admin import Admin, admin_routes
from pdserve.router.http.choices import Choices, chunks, collect_whole
from pdserve.router.http.middleware import (
    BODY_TIMEOUT_S,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from pdserve.router.http.request import (
    ApiError,
    ClientGone,
    invalid,
    read_json,
    unless_disconnected,
)
from pdserve.router.http.server import HttpServer, start_http_server
from pdserve.router.metrics import metrics_text
from pdserve.router.openai.request_mapping import (
    Plan,
    chat_echo,
    chat_request,
    check_grammars,
    choice_requests,
    completion_request,
)
from pdserve.router.openai.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    validate_body,
)
from pdserve.router.openai.response_objects import (
    ResponseBuilder,
    TokenText,
    error_object,
    router_error_object,
)
from pdserve.router.openai.responses_api import (
    REFUSED_RESPONSES,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    chat_body,
    renamed,
    response_object,
    responses_field,
    skeleton,
    wants_logprobs,
)
from pdserve.router.openai.tokenize import (
    DetokenizeRequest,
    detokenize,
    parse_tokenize,
    tokenize,
)
from pdserve.router.openai.tool_parsers import syntax_for
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    ModelInfo,
    RouterError,
    StreamChunk,
    Usage,
)
from pdserve.tracing import trace_headers

log = logging.getLogger("pdserve.http")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
T = TypeVar("T")
__all__ = ["DEFAULT_MAX_BODY_BYTES", "HttpServer", "build_app", "start_http_server"]


class _Api:
    """The handlers' shared state: one per app."""

    def __init__(self, router: RouterLike, model_name: str, registry: CollectorRegistry):
        self.router = router
        self.model_name = model_name
        self.registry = registry
        self.text = TokenText(router.tokenizer)
        self.tools = syntax_for(router.tokenizer.chat_template)  # the model's tool calls
        self.stored = ResponseStore()  # /v1/responses kept for previous_response_id
        for name, doc, value in (
                ("pdserve_responses_kept", "Responses kept for previous_response_id.",
                 lambda: len(self.stored)),
                ("pdserve_responses_kept_bytes", "JSON bytes of the kept responses and "
                 "their conversations.", lambda: self.stored.bytes)):
            Gauge(name, doc, ("model",), registry=registry).labels(
                model=model_name).set_function(value)
        self.tasks: set[asyncio.Task[None]] = set()  # RouterStream tasks until cleaned up
        self.in_flight: dict[str, Choices] = {}  # by request id (ids must be unique)
        self.closing = False

    def begin_shutdown(self) -> None:
        """New requests get 503; open ones end now with a 503 / an SSE error event."""
        self.closing = True
        error = RouterError(ErrorKind.NOT_READY, "the server is shutting down")
        for choices in list(self.in_flight.values()):
            choices.close(error)

    async def generate(self, request: Request, chat: bool) -> Response:
        rid: str = request.state.request_id
        return await self._serve(request, rid, await read_json(request, rid), chat)

    async def responses(self, request: Request) -> Response:
        """``/v1/responses``: served as the chat body it maps to (``openai.responses_api``)."""
        rid: str = request.state.request_id
        body = await read_json(request, rid)
        try:
            r: ResponsesRequest = self.stored.continued(
                validate_body(ResponsesRequest, body, REFUSED_RESPONSES))
        except InvalidRequest as exc:
            raise invalid(exc, rid) from exc
        base = skeleton(r, r.model or self.model_name, int(time.time()))
        log.info("request %s: response %s", rid, base["id"])
        return await self._serve(request, rid, chat_body(r), True, _Responses(
            base, wants_logprobs(r), lambda whole: self.stored.keep(r, whole)))

    async def tokenizer_call(self, request: Request, detok: bool) -> Response:
        """``/tokenize`` and ``/detokenize`` (``openai.tokenize``)."""
        rid: str = request.state.request_id
        body = await read_json(request, rid)
        try:
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                check_model(self.router, body["model"])
            tok = self.router.tokenizer
            if detok:
                return JSONResponse(detokenize(validate_body(DetokenizeRequest, body), tok))
            return JSONResponse(tokenize(parse_tokenize(body), tok, self.tools,
                                         self.router.models()[0].max_model_len))
        except InvalidRequest as exc:
            raise invalid(exc, rid) from exc
        except RouterError as exc:
            raise ApiError.from_router(exc, rid) from exc

    def stored_response(self, response_id: str, forget: bool) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}``: a kept response, or a 404."""
        whole = self.stored.get(response_id)
        if whole is None:
            return JSONResponse(error_object(
                f"no response {response_id!r} is kept here (store false, forgotten, or "
                "answered before a restart)", code="not_found"), status_code=404)
        if forget:
            self.stored.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return JSONResponse(whole)

    async def _serve(self, request: Request, rid: str, body: Any, chat: bool,
                     responses: _Responses | None = None) -> Response:
        """Serve a completions or chat ``body``; with ``responses``, answer as the
        Responses API."""
        fields: dict[str, str] = {}
        try:
            if isinstance(body, dict):
                check_model(self.router, body.get("model") if isinstance(
                    body.get("model"), str) else None)
            max_len = self.router.models()[0].max_model_len
            parsed: ChatCompletionRequest | CompletionRequest
            plan: Plan
            echo: list[tuple[str, list[int]]] | None = None
            prompt_ids: list[list[int]] | None = None
            if chat:
                parsed, req, plan = chat_request(body, rid, lambda m, t, kw: len(
                    self.router.tokenizer.apply_chat_template(m, tools=t, **kw)), max_len,
                    self.tools, self.router.tokenizer.renders_tools)
                reqs = [req]
                logprobs = parsed.logprobs
            else:
                parsed, reqs, plan = completion_request(body, rid)
                logprobs = parsed.logprobs is not None
            n = parsed.n or 1
            fields = _router_fields(parsed, responses is not None)
            echoed = isinstance(parsed, CompletionRequest) and parsed.echo
            if echoed or parsed.return_token_ids:
                # echo: each prompt leads its choices' output, its text and its tokens;
                # return_token_ids: the tokens beside the output. Tokenized once here.
                prompt_ids = [self.router.prompt_ids(req) for req in reqs]
                if echoed:
                    echo = [(req.prompt if req.prompt is not None
                             and req.truncate_prompt_tokens is None
                             else self.router.tokenizer.decode(ids), ids)
                            for req, ids in zip(reqs, prompt_ids, strict=True)]
                for req, ids in zip(reqs, prompt_ids, strict=True):
                    req.prompt, req.messages, req.prompt_token_ids = None, None, ids
            await check_grammars(plan.grammars)
        except InvalidRequest as exc:
            raise invalid(exc if responses is None else renamed(exc), rid) from exc
        except RouterError as exc:  # echo, return_token_ids: the prompt checked as tokenized
            raise ApiError.from_router(exc, rid, fields) from exc
        if rid in self.in_flight:
            raise ApiError(400, error_object(f"request id {rid!r} is already in flight",
                                             param="X-Request-Id"))
        trace = trace_headers(request.headers)  # the client's trace goes on (tracing.py)
        for req in reqs:
            req.trace = trace
        if self.closing:
            raise ApiError.from_router(RouterError(ErrorKind.NOT_READY,
                                                   "the server is shutting down"), rid)
        out = ResponseBuilder(
            chat=chat, request_id=rid, model=parsed.model or self.model_name,
            created=int(time.time()), logprobs=logprobs,
            text=self.text.as_ids() if parsed.return_tokens_as_token_ids else self.text,
            include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
            continuous_usage=bool(parsed.stream_options
                                  and parsed.stream_options.continuous_usage_stats),
            prompt_logprobs=parsed.prompt_logprobs,
            echo_top=(parsed.logprobs or 0) if isinstance(parsed, CompletionRequest) else 0,
            chat_echo=chat_echo(parsed) if isinstance(parsed, ChatCompletionRequest) else "",
            prompt_ids=prompt_ids if parsed.return_token_ids else None,
            echo=echo, n=n, prompts=len(reqs), tools=plan.tools)
        if parsed.use_beam_search:
            try:
                return JSONResponse(await unless_disconnected(
                    request, self._beam_search(reqs, n, parsed.length_penalty, out)))
            except RouterError as exc:
                raise ApiError.from_router(exc, rid, fields) from exc
        choices = self.in_flight[rid] = Choices(
            self.router, [c for req in reqs for c in choice_requests(req, n)], n, self.tasks, rid)
        handed_over = False
        try:
            await unless_disconnected(request, choices.start())
            if parsed.stream:
                handed_over = True
                # The background task also runs when the client left before the
                # body started (then _sse never ran and its finally cannot).
                return StreamingResponse(self._sse(choices, out, responses),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"},
                                         background=BackgroundTask(self._done, choices))
            whole = await unless_disconnected(request, collect_whole(choices, out))
            if responses is not None:
                whole = response_object(responses.base, whole, responses.logprobs)
                responses.done(whole)
            return JSONResponse(whole)
        except RouterError as exc:
            raise ApiError.from_router(exc, rid, fields) from exc
        finally:
            if not handed_over:
                self._done(choices)

    async def _beam_search(self, reqs: list[GenerateRequest], width: int, length_penalty: float,
                           out: ResponseBuilder) -> dict[str, Any]:
        """Each prompt's ``width`` best beams as its choices (``beam_search``)."""
        tok = self.router.tokenizer
        finals = []
        for p, req in enumerate(reqs):
            prompt = self.router.prompt_ids(req)
            beams = await beam_search(self.router, req, prompt, width, length_penalty,
                                      tok.eos_token_ids, self.tasks)
            for i, beam in enumerate(beams):
                text = tok.decode(beam.tokens, skip_special_tokens=req.params.skip_special_tokens)
                out.add(StreamChunk(beam.tokens, text, beam.logprobs), p * width + i)
                finals.append(FinalChunk("stop" if beam.finished else "length",
                                         Usage(len(prompt), len(beam.tokens))))
        return out.response(finals)

    def _done(self, choices: Choices) -> None:
        choices.close()
        self.in_flight.pop(choices.request_id, None)

    async def _sse(self, choices: Choices, out: ResponseBuilder,
                   responses: _Responses | None) -> AsyncIterator[bytes]:
        # Runs inside the response; a disconnect cancels it (Starlette) and the
        # finally closes the router streams.
        def failed(exc: RouterError) -> dict[str, Any]:
            log.warning("request %s failed mid-stream: %s", choices.request_id, exc.message)
            error: dict[str, Any] = router_error_object(exc, choices.request_id)[1]["error"]
            return error

        try:
            if responses is not None:
                events = ResponseEvents(responses.base, responses.logprobs)
                async for event in events.events(chunks(choices, out), failed, responses.done):
                    yield event
                return
            try:
                async for obj in chunks(choices, out):
                    yield _event(obj)
            except RouterError as exc:
                yield _event({"error": failed(exc)})
        finally:
            self._done(choices)
        yield b"data: [DONE]\n\n"


def _router_fields(parsed: ChatCompletionRequest | CompletionRequest,
                   responses: bool) -> dict[str, str]:
    """The request's own name of each router request field that the API names
    differently: a chat's prompt is its ``messages``, its limit the one it set."""
    if isinstance(parsed, CompletionRequest):
        return {}
    fields = {"prompt": "messages", "max_tokens": "max_completion_tokens"
              if parsed.max_completion_tokens is not None else "max_tokens"}
    return {k: responses_field(v) for k, v in fields.items()} if responses else fields


@dataclass(frozen=True)
class _Responses:
    """A request of the Responses API: its response's settings (``skeleton``), whether
    it asked for logprobs, and what to do with the whole response (keep it)."""

    base: dict[str, Any]
    logprobs: bool
    done: Callable[[dict[str, Any]], None]


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


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
    api = _Api(router, model_name, registry)

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await api.generate(request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.generate(request, chat=True)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        return await api.responses(request)

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return api.stored_response(response_id, forget=False)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return api.stored_response(response_id, forget=True)

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
    app.state.pdserve_api = api  # for HttpServer.stop(): begin_shutdown(), tasks

    # vLLM's tokenizer endpoints (outside /v1, as vLLM serves them)
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await api.tokenizer_call(request, detok=False)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await api.tokenizer_call(request, detok=True)

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
