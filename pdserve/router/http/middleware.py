"""ASGI middleware of the OpenAI HTTP API, outermost first:

* ``RequestIdMiddleware``: takes ``X-Request-Id`` (or makes one), keeps it in
  ``scope["state"]["request_id"]``, echoes it on every response, and writes one
  access log line per request carrying it.
* ``BodyLimitMiddleware``: a request body larger than the limit gets a 413 before
  any of it is parsed: at once from a declared ``Content-Length`` (before reading a
  byte of it), otherwise (chunked) as soon as the bytes read pass the limit. A body
  not whole within ``body_timeout_s`` (a client that declares 100 bytes and sends 10)
  gets a 408 and its connection is closed, so slow clients cannot pile up. The body
  is read here whole and replayed to the app; later ``receive()`` calls go to the
  server, so disconnects still arrive.
* ``ApiKeyMiddleware`` (with keys configured): every path needs ``Authorization:
  Bearer <key>`` (401 otherwise) except the probes ``/health``, ``/metrics`` and
  ``/metrics/targets``, which stay open unless ``protect_probes``. Deny by default: a route added later
  (``/admin/*``, ...) is protected without anyone remembering to.

A 413 and its connection: the whole response is written first (so the client can
read it at once), then, while the response is still open, the rest of the body is
read and dropped (bounded by `DRAIN_FACTOR` x the limit and `DRAIN_TIMEOUT_S`), and
only then is the connection closed. Closing a socket that still holds unread bytes
resets it, and a client that sends the whole body before reading would see that
reset instead of the 413. A client that sent ``Expect: 100-continue`` never sends
the body, so nothing is drained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.api.common import REQUEST_ID_KEY, checked_request_id
from pdserve.router.api.keys import ApiKeys
from pdserve.router.openai.response_objects import error_object

log = logging.getLogger("pdserve.http")

_HEADER = REQUEST_ID_KEY.encode()


async def send_error(send: Send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        try:
            rid = checked_request_id(_header(scope, _HEADER))
        except ValueError as exc:
            await send_error(send, 400, error_object(f"X-Request-Id: {exc}", param="X-Request-Id"))
            return
        scope.setdefault("state", {})["request_id"] = rid
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (_HEADER, rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info("%s %s %s request_id=%s %.3fs", scope["method"], scope["path"],
                     status[0] or "-", rid, time.monotonic() - start)


# A rejected body is read (and dropped) up to this many times the limit, for at
# most this long.
DRAIN_FACTOR = 8
DRAIN_TIMEOUT_S = 5.0


BODY_TIMEOUT_S = 30.0  # a request's whole body must arrive within this


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = BODY_TIMEOUT_S):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.app = app
        self.limit = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def _too_slow(self, send: Send) -> None:
        body = json.dumps(error_object(
            f"the request body did not arrive within {self.body_timeout_s:g} s",
            code="request_timeout")).encode()
        await send({"type": "http.response.start", "status": 408, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _reject(self, scope: Scope, receive: Receive, send: Send, more: bool) -> None:
        """413 now; then drop the rest of the body before the connection closes (see
        the module docstring)."""
        body = json.dumps(error_object(f"request body is larger than {self.limit} bytes",
                                       code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if _header(scope, b"expect") == "100-continue":
            more = False
        budget = DRAIN_FACTOR * self.limit
        loop = asyncio.get_running_loop()
        give_up = loop.time() + DRAIN_TIMEOUT_S
        while more and budget > 0:
            try:
                async with asyncio.timeout_at(give_up):
                    message = await receive()
            except TimeoutError:
                break
            if message["type"] != "http.request":
                break
            budget -= len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send, more=True)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away while sending
                        return
                    size += len(message.get("body", b""))
                    if size > self.limit:
                        await self._reject(scope, receive, send,
                                           more=message.get("more_body", False))
                        return
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._too_slow(send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


PROBES = ("/health", "/metrics", "/metrics/targets")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys, protect_probes: bool = False):
        self.app = app
        self.keys = keys
        self.protect_probes = protect_probes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or (scope["path"] in PROBES and not self.protect_probes)
                or self.keys.accepts_header(_header(scope, b"authorization"))):
            await self.app(scope, receive, send)
            return
        await send_error(send, 401, error_object(
            "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"),
            [(b"www-authenticate", b"Bearer")])
