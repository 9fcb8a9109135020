"""What every HTTP endpoint shares: the app's state (``Served``), the base of the
endpoints (``Endpoint``) and of the generate ones (``GenerateEndpoint``).

A generate endpoint (``completions``, ``chat``) maps its body to router requests
(``prepare``: the body model maps itself) and says how its responses are built
(``builder``); the base serves the rest the same for every endpoint: the model check,
the prompt's token ids when asked for (echo, ``return_token_ids``), the constraints
compiled before the request runs, beam search, the ``n`` choices (``Choices``), and
the answer streamed or whole -- as OpenAI's objects (``Answer``), or as another API
answers (``http.responses``).

A request's first stream item is awaited before the response starts, so admission
failures (429 with ``Retry-After``, 400s from the router) keep their status even when
streaming; a router error after that becomes an SSE error event followed by
``[DONE]``. Cancellation: a client that goes away, before or during the response,
closes its ``RouterStream``s (one per choice), which abort the request on both
workers (``api.router_stream``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pdserve.router.api.beam_search import beam_search
from pdserve.router.api.common import RouterLike, check_model
from pdserve.router.http.choices import Choices, chunks, collect_whole
from pdserve.router.http.request import ApiError, invalid, read_json, unless_disconnected
from pdserve.router.openai.request_models import InvalidRequest
from pdserve.router.openai.response_builder import ResponseBuilder
from pdserve.router.openai.response_objects import TokenText, error_object, router_error_object
from pdserve.router.openai.sampling_fields import (
    Plan,
    SamplingFields,
    check_grammars,
    choice_requests,
)
from pdserve.router.openai.tool_parsers import syntax_for
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    RouterError,
    StreamChunk,
    Usage,
)
from pdserve.tracing import trace_headers

log = logging.getLogger("pdserve.http")
B = TypeVar("B", bound=SamplingFields)  # an endpoint's body


class Served:
    """The app's state, one per app (``app.state.pdserve_api``): the router, the
    served model's name, how tokens are written, the model's tool-call syntax, the
    router streams' tasks until cleaned up, and the requests in flight."""

    def __init__(self, router: RouterLike, model_name: str):
        self.router = router
        self.model_name = model_name
        self.text = TokenText(router.tokenizer)
        self.tools = syntax_for(router.tokenizer.chat_template)  # the model's tool calls
        self.tasks: set[asyncio.Task[None]] = set()  # RouterStream tasks until cleaned up
        self.in_flight: dict[str, Choices] = {}  # by request id (ids must be unique)
        self.closing = False

    def begin_shutdown(self) -> None:
        """New requests get 503; open ones end now with a 503 / an SSE error event."""
        self.closing = True
        error = RouterError(ErrorKind.NOT_READY, "the server is shutting down")
        for choices in list(self.in_flight.values()):
            choices.close(error)


class Endpoint:
    """One endpoint's handlers over the app's state."""

    def __init__(self, served: Served):
        self.served = served
        self.router = served.router

    def check_model(self, body: Any) -> None:
        """RouterError unless a body's ``model`` (when it names one) is served here."""
        if isinstance(body, dict):
            check_model(self.router, body.get("model") if isinstance(
                body.get("model"), str) else None)


@dataclass
class Prepared(Generic[B]):
    """A generate body mapped for the router (``GenerateEndpoint.prepare``)."""

    body: B  # the validated body
    reqs: list[GenerateRequest]  # one per prompt
    plan: Plan  # constraints to compile, the syntax tool calls are read with
    fields: dict[str, str]  # the body's name of each router field it names otherwise
    echo: bool = False  # completions' echo: each prompt leads its choices' output


class Answer:
    """How a generate request is answered: OpenAI's objects, whole or as SSE
    ``data: {json}`` events ending with ``data: [DONE]`` (``end``). Another API's
    answer overrides these (``http.responses``)."""

    end = b"data: [DONE]\n\n"  # sent after the request is done

    def invalid(self, exc: InvalidRequest) -> InvalidRequest:
        """The 400 as the client should read it."""
        return exc

    def fields(self, fields: dict[str, str]) -> dict[str, str]:
        """``Prepared.fields`` as the client named them."""
        return fields

    def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The whole response as the client reads it."""
        return obj

    async def events(self, objs: AsyncIterator[dict[str, Any]],
                     failed: Callable[[RouterError], dict[str, Any]]) -> AsyncIterator[bytes]:
        """The stream's events; a router error mid-stream is an error event."""
        try:
            async for obj in objs:
                yield event(obj)
        except RouterError as exc:
            yield event({"error": failed(exc)})


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class GenerateEndpoint(Endpoint, ABC, Generic[B]):
    """A generate endpoint: ``prepare`` and ``builder`` are its own, the rest shared."""

    @abstractmethod
    def prepare(self, body: Any, rid: str) -> Prepared[B]:
        """The body validated and mapped to router requests; InvalidRequest."""

    @abstractmethod
    def builder(self, p: Prepared[B], prompt_ids: list[list[int]] | None,
                echo: list[tuple[str, list[int]]] | None, **common: Any) -> ResponseBuilder:
        """The response builder of ``p`` (``common``: the keywords every endpoint's
        builder takes alike)."""

    async def handle(self, request: Request) -> Response:
        """Answer one request of the route."""
        rid: str = request.state.request_id
        return await self.serve(request, rid, await read_json(request, rid), Answer())

    async def serve(self, request: Request, rid: str, body: Any, answer: Answer) -> Response:
        """Serve ``body`` (request id ``rid``) and answer as ``answer`` says; ApiError."""
        fields: dict[str, str] = {}
        try:
            self.check_model(body)
            p = self.prepare(body, rid)
            fields = answer.fields(p.fields)
            echo: list[tuple[str, list[int]]] | None = None
            prompt_ids: list[list[int]] | None = None
            if p.echo or p.body.return_token_ids:
                # echo: each prompt leads its choices' output, its text and its tokens;
                # return_token_ids: the tokens beside the output. Tokenized once here.
                prompt_ids = [self.router.prompt_ids(req) for req in p.reqs]
                if p.echo:
                    echo = [(req.prompt if req.prompt is not None
                             and req.truncate_prompt_tokens is None
                             else self.router.tokenizer.decode(ids), ids)
                            for req, ids in zip(p.reqs, prompt_ids, strict=True)]
                for req, ids in zip(p.reqs, prompt_ids, strict=True):
                    req.prompt, req.messages, req.prompt_token_ids = None, None, ids
            await check_grammars(p.plan.grammars)
        except InvalidRequest as exc:
            raise invalid(answer.invalid(exc), rid) from exc
        except RouterError as exc:  # echo, return_token_ids: the prompt checked as tokenized
            raise ApiError.from_router(exc, rid, fields) from exc
        if rid in self.served.in_flight:
            raise ApiError(400, error_object(f"request id {rid!r} is already in flight",
                                             param="X-Request-Id"))
        trace = trace_headers(request.headers)  # the client's trace goes on (tracing.py)
        for req in p.reqs:
            req.trace = trace
        if self.served.closing:
            raise ApiError.from_router(RouterError(ErrorKind.NOT_READY,
                                                   "the server is shutting down"), rid)
        b = p.body
        out = self.builder(
            p, prompt_ids if b.return_token_ids else None, echo, request_id=rid,
            model=b.model or self.served.model_name, created=int(time.time()),
            text=self.served.text.as_ids() if b.return_tokens_as_token_ids else self.served.text,
            include_usage=bool(b.stream_options and b.stream_options.include_usage),
            continuous_usage=bool(b.stream_options and b.stream_options.continuous_usage_stats),
            prompt_logprobs=b.prompt_logprobs, n=b.n or 1, prompts=len(p.reqs))
        try:
            if b.use_beam_search:
                return JSONResponse(await unless_disconnected(
                    request, self._beam_search(p.reqs, b.n or 1, b.length_penalty, out)))
            return await self._choices(request, rid, p, out, answer)
        except RouterError as exc:
            raise ApiError.from_router(exc, rid, fields) from exc

    async def _choices(self, request: Request, rid: str, p: Prepared[B], out: ResponseBuilder,
                       answer: Answer) -> Response:
        """The ``n`` choices of each prompt, streamed or whole; RouterError."""
        n = p.body.n or 1
        choices = self.served.in_flight[rid] = Choices(
            self.router, [c for req in p.reqs for c in choice_requests(req, n)], n,
            self.served.tasks, rid)
        handed_over = False
        try:
            await unless_disconnected(request, choices.start())
            if p.body.stream:
                handed_over = True
                # The background task also runs when the client left before the
                # body started (then _sse never ran and its finally cannot).
                return StreamingResponse(self._sse(choices, out, answer),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"},
                                         background=BackgroundTask(self._done, choices))
            whole = await unless_disconnected(request, collect_whole(choices, out))
            return JSONResponse(answer.whole(whole))
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
                                      tok.eos_token_ids, self.served.tasks)
            for i, beam in enumerate(beams):
                text = tok.decode(beam.tokens, skip_special_tokens=req.params.skip_special_tokens)
                out.add(StreamChunk(beam.tokens, text, beam.logprobs), p * width + i)
                finals.append(FinalChunk("stop" if beam.finished else "length",
                                         Usage(len(prompt), len(beam.tokens))))
        return out.response(finals)

    def _done(self, choices: Choices) -> None:
        choices.close()
        self.served.in_flight.pop(choices.request_id, None)

    async def _sse(self, choices: Choices, out: ResponseBuilder,
                   answer: Answer) -> AsyncIterator[bytes]:
        # Runs inside the response; a disconnect cancels it (Starlette) and the
        # finally closes the router streams.
        def failed(exc: RouterError) -> dict[str, Any]:
            log.warning("request %s failed mid-stream: %s", choices.request_id, exc.message)
            error: dict[str, Any] = router_error_object(exc, choices.request_id)[1]["error"]
            return error

        try:
            async for obj in answer.events(chunks(choices, out), failed):
                yield obj
        finally:
            self._done(choices)
        if answer.end:
            yield answer.end
