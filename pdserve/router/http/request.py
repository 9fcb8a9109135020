"""What every HTTP route shares about a request: its errors as OpenAI error objects
with a status (``ApiError``), its JSON body read and checked (``read_json``: 415, 400),
and waiting on work unless the client disconnects first (``unless_disconnected``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from fastapi import Request

from pdserve.router.api.public_errors import public_message
from pdserve.router.http.json_body import BadJson, parse_json
from pdserve.router.openai.request_models import InvalidRequest
from pdserve.router.openai.response_objects import error_object, router_error_object
from pdserve.router.types import ErrorKind, RouterError

T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        self.status, self.body, self.headers = status, body, headers or {}

    @classmethod
    def from_router(cls, exc: RouterError, request_id: str,
                    fields: Mapping[str, str] | None = None) -> ApiError:
        """``fields``: the client's name of each router request field it sent
        differently (chat's ``messages`` for ``prompt``, ...)."""
        param = None if exc.param is None else (fields or {}).get(exc.param, exc.param)
        status, body = router_error_object(exc, request_id, param)
        headers = {}
        if exc.kind is ErrorKind.OVERLOADED or (exc.kind is ErrorKind.NOT_READY
                                                and exc.retry_after_s is not None):
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s or 1)))
        return cls(status, body, headers)


async def read_json(request: Request, rid: str) -> Any:
    """The request's JSON body; ApiError (415, 400) if it is not one."""
    check_json_content_type(request)
    try:
        return parse_json(await request.body())
    except BadJson as exc:
        raise ApiError(400, error_object(public_message(ErrorKind.INVALID, exc.message, rid),
                                         param=exc.param)) from exc


def invalid(exc: InvalidRequest, rid: str) -> ApiError:
    return ApiError(400, error_object(public_message(ErrorKind.INVALID, exc.message, rid),
                                      param=exc.param))


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (charset, if given, UTF-8)."""
    media, *params = request.headers.get("content-type", "").split(";")
    charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in params
                    if p.strip().lower().startswith("charset=")), "utf-8")
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(415, error_object("the request body must be JSON, sent with "
                                         "Content-Type: application/json",
                                         code="unsupported_media_type"))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first (then ``ClientGone``)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone


class ClientGone(Exception):
    """The client disconnected before the response started."""
