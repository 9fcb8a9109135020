"""``POST /v1/responses`` (what the Agents SDK and Codex speak) and ``GET`` / ``DELETE
/v1/responses/{id}``: a Responses body is served as the chat body it maps to (the
``Chat`` endpoint), answered in the Responses API's shapes and typed events
(``openai.responses``), and kept for ``previous_response_id`` unless ``store`` is
false (``ResponseStore``, with its gauges)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Gauge

from pdserve.router.http.chat import Chat
from pdserve.router.http.endpoint import Answer, Endpoint
from pdserve.router.http.request import invalid, read_json
from pdserve.router.openai.request_models import InvalidRequest, validate_body
from pdserve.router.openai.response_objects import error_object
from pdserve.router.openai.responses.output import ResponseEvents, response_object, skeleton
from pdserve.router.openai.responses.request import (
    REFUSED_RESPONSES,
    ResponsesRequest,
    renamed,
    responses_field,
)
from pdserve.router.openai.responses.store import ResponseStore
from pdserve.router.types import RouterError

log = logging.getLogger("pdserve.http")


class _ResponsesAnswer(Answer):
    """A chat answered as a response: ``base`` is its settings (``skeleton``),
    ``logprobs`` whether it asked for them, ``keep`` what is done with the whole
    response. Its stream ends with its last typed event (no ``[DONE]``)."""

    end = b""

    def __init__(self, base: dict[str, Any], logprobs: bool,
                 keep: Callable[[dict[str, Any]], None]):
        self.base, self.logprobs, self.keep = base, logprobs, keep

    def invalid(self, exc: InvalidRequest) -> InvalidRequest:
        return renamed(exc)

    def fields(self, fields: dict[str, str]) -> dict[str, str]:
        return {k: responses_field(v) for k, v in fields.items()}

    def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        whole = response_object(self.base, obj, self.logprobs)
        self.keep(whole)
        return whole

    async def events(self, objs: AsyncIterator[dict[str, Any]],
                     failed: Callable[[RouterError], dict[str, Any]]) -> AsyncIterator[bytes]:
        events = ResponseEvents(self.base, self.logprobs)
        async for event in events.events(objs, failed, self.keep):
            yield event


class Responses(Endpoint):
    def __init__(self, chat: Chat, registry: CollectorRegistry):
        super().__init__(chat.served)
        self.chat = chat
        self.stored = ResponseStore()  # kept for previous_response_id
        model = chat.served.model_name
        for name, doc, value in (
                ("pdserve_responses_kept", "Responses kept for previous_response_id.",
                 lambda: len(self.stored)),
                ("pdserve_responses_kept_bytes", "JSON bytes of the kept responses and "
                 "their conversations.", lambda: self.stored.bytes)):
            Gauge(name, doc, ("model",), registry=registry).labels(model=model).set_function(value)

    async def handle(self, request: Request) -> Response:
        """Answer one request of the route."""
        rid: str = request.state.request_id
        body = await read_json(request, rid)
        try:
            r: ResponsesRequest = self.stored.continued(
                validate_body(ResponsesRequest, body, REFUSED_RESPONSES))
        except InvalidRequest as exc:
            raise invalid(exc, rid) from exc
        base = skeleton(r, r.model or self.served.model_name, int(time.time()))
        log.info("request %s: response %s", rid, base["id"])
        return await self.chat.serve(request, rid, r.to_chat_body(), _ResponsesAnswer(
            base, r.wants_logprobs(), lambda whole: self.stored.keep(r, whole)))

    def kept(self, response_id: str, forget: bool) -> Response:
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
