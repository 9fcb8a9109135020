"""The OpenAPI document of the HTTP API (``GET /openapi.json``), describing what
the handlers really take and answer.

The generate routes read their bodies by hand (each body model validates
them strictly and maps errors to OpenAI's shape), so FastAPI alone would publish
no request body at all. This module adds, per route:

* the request body: the JSON schema of the pydantic model, plus the refused
  fields with their harmless values (each body's ``REFUSED_*``), plus the served
  model names;
* every status the route can answer, with its content type: 200 as JSON (or SSE
  for a stream), errors as OpenAI's error object;
* the Bearer scheme when API keys are set.

The fuzz suite (``tests/fuzz``) generates requests from this document and checks
the server against it both ways: a body the schema allows is never refused for a
field the schema describes, and one it forbids is always a 4xx.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdserve.router.openai.chat_request import REFUSED_CHAT, ChatCompletionRequest
from pdserve.router.openai.completion_request import REFUSED_COMPLETION, CompletionRequest
from pdserve.router.openai.request_models import IGNORED_FIELDS, Refused
from pdserve.router.openai.responses.request import REFUSED_RESPONSES, ResponsesRequest
from pdserve.router.openai.tokenize import (
    REFUSED_TOKENIZE_CHAT,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_WHY = {
    400: "invalid request", 401: "missing or invalid API key",
    404: "unknown model (a kept response: unknown id)",
    413: "body too large", 415: "body not application/json", 429: "overloaded (Retry-After)",
    500: "internal error", 503: "not ready", 504: "deadline passed",
}
_GENERATE = (400, 404, 413, 415, 429, 500, 503, 504)


def _errors(statuses: Sequence[int]) -> dict[str, Any]:
    return {str(s): {"description": _WHY[s], **_ERROR} for s in statuses}


def _schema(model: type[BaseModel], refused: dict[str, Refused], served: Sequence[str],
            schemas: dict[str, Any]) -> dict[str, Any]:
    """A reference to the body schema of ``model``, which goes into ``schemas`` with
    its sub-schemas."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schema["properties"].update({name: rule.schema for name, rule in refused.items()})
    # ignored fields take anything; no other field is accepted (models.validate_body)
    schema["properties"].update({name: {} for name in IGNORED_FIELDS
                                 if name not in schema["properties"]})
    schema["additionalProperties"] = False
    schema["properties"]["model"] = {"anyOf": [{"type": "null"}, {"enum": list(served)}]}
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _json(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"type": "object"}}}}


def openapi_document(app: FastAPI, served: Sequence[str], keyed: bool,
                     protect_probes: bool) -> dict[str, Any]:
    """The document for ``app`` (routes as ``http.app.build_app`` makes them)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    keyed_errors = [401] if keyed else []
    paths = doc["paths"]
    for path, model, refused in (("/v1/completions", CompletionRequest, REFUSED_COMPLETION),
                                 ("/v1/chat/completions", ChatCompletionRequest, REFUSED_CHAT),
                                 ("/v1/responses", ResponsesRequest, REFUSED_RESPONSES)):
        op = paths[path]["post"]
        op["requestBody"] = _body(_schema(model, refused, served, schemas))
        op["responses"] = {"200": {"description": "the answer, or its SSE stream", "content": {
            "application/json": {"schema": {"type": "object"}},
            # one schema per event: each event's data is JSON (completions and chat: a
            # chunk, the last "[DONE]"; responses: a typed event, named by `event:`)
            "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                             "properties": {"data": {"type": "string"}}}}}},
            **_errors([*_GENERATE, *keyed_errors])}
    for method, what in (("get", "the kept response"), ("delete", "the response forgotten")):
        paths["/v1/responses/{response_id}"][method]["responses"] = {
            "200": _json(what), **_errors([404, *keyed_errors])}
    paths["/v1/models"]["get"]["responses"] = {
        "200": _json("the served models"), **_errors(keyed_errors)}
    paths["/v1/models/{model_id}"]["get"]["responses"] = {
        "200": _json("the served model"), **_errors([404, *keyed_errors])}
    # /tokenize: a prompt's body, or a chat's (one with ``messages``)
    plain = _schema(TokenizeCompletionRequest, {}, served, schemas)
    schemas[TokenizeCompletionRequest.__name__]["not"] = {"required": ["messages"]}
    chat = _schema(TokenizeChatRequest, REFUSED_TOKENIZE_CHAT, served, schemas)
    for path, schema, what in (
            ("/tokenize", {"anyOf": [plain, chat]}, "the token ids (and their count)"),
            ("/detokenize", _schema(DetokenizeRequest, {}, served, schemas), "their text")):
        paths[path]["post"]["requestBody"] = _body(schema)
        paths[path]["post"]["responses"] = {
            "200": _json(what), **_errors([400, 404, 413, 415, *keyed_errors])}
    paths["/tokenizer_info"]["get"]["responses"] = {
        "200": _json("the tokenizer's settings and chat template"), **_errors(keyed_errors)}
    probe_errors = [401] if keyed and protect_probes else []
    paths["/health"]["get"]["responses"] = {
        "200": _json("both pools can serve"), **_errors([503, *probe_errors])}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(probe_errors)}
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path not in ("/health", "/metrics") or protect_probes:
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc


def install(app: FastAPI, served: Sequence[str], keyed: bool, protect_probes: bool) -> None:
    """Serve `openapi_document` (built once, on first request) as ``/openapi.json``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, served, keyed, protect_probes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
