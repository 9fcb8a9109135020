"""The router's gRPC front door: ``pdserve.v1.Generation`` plus ``grpc.health.v1``.

The messages map to the router's types in ``grpc.messages``; this module owns the
service: ``RouterError`` kinds -> gRPC status codes, the health status (SERVING only
while ``router.ready()``, re-read periodically), the API keys and the stream's end.
A structured-output constraint is compiled (``messages.check_structured``) before the
request reaches the router, so a bad schema is INVALID_ARGUMENT naming the field and
nothing is queued for it.

Bad input is INVALID_ARGUMENT, never INTERNAL or UNKNOWN: requests arrive as raw
bytes and are parsed here, so a corrupt message (bad wire format, invalid UTF-8)
is the client's error rather than a failed deserializer; a ``request_id`` must be
1-128 printable ASCII characters (it goes into metadata and logs). Status
messages are what ``api.public_errors`` lets a client see.

API keys: with keys, every call needs metadata ``authorization: Bearer <key>``
(UNAUTHENTICATED otherwise), ``grpc.health.v1`` excepted unless ``protect_probes``.

Cancellation rule: whatever ends an RPC early (client cancel, gRPC deadline, a
closed stream) ends the handler task, and the handler then closes the router's
stream (``aclose()``), which is how the router learns to abort the request on its
workers. Responses are written with ``context.write`` from one coroutine (not
yielded) so this close is deterministic rather than left to garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.protos import pb
from pdserve.router.api.common import (
    REQUEST_ID_KEY,
    RouterLike,
    check_model,
)
from pdserve.router.api.keys import ApiKeys
from pdserve.router.api.public_errors import public_message
from pdserve.router.api.router_stream import close_stream
from pdserve.router.grpc.messages import (
    check_structured,
    request_from_proto,
    response_from_item,
    structured_field,
)
from pdserve.router.types import (
    ErrorKind,
    RouterError,
)
from pdserve.tracing import trace_headers

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"
RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED: seconds, like HTTP
# REQUEST_ID_KEY (api.common): initial metadata of Generate, the id the router used
__all__ = ["REQUEST_ID_KEY", "RETRY_AFTER_KEY", "SERVICE_NAME",
           "GenerationServicer", "RouterLike", "start_grpc_server"]

STATUS_OF = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

def _parse(message_type: Any, raw: bytes) -> Any:
    """A request message from its wire bytes; ValueError when they are not one."""
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise ValueError(f"the request is not a valid {message_type.DESCRIPTOR.full_name} "
                         f"message") from exc


class GenerationServicer:
    """Implements ``pdserve.v1.Generation`` over a router."""

    def __init__(self, router: RouterLike):
        self._router = router
        self.health_task: asyncio.Task[None] | None = None  # held here so it is never GC'd

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, taking their requests as raw bytes (see the module doc)."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate_raw, response_serializer=pb.GenerateResponse.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self._list_models_raw,
                response_serializer=pb.ListModelsResponse.SerializeToString),
        })

    async def _generate_raw(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            request = _parse(pb.GenerateRequest, raw)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return  # not reached: abort() raises
        await self.Generate(request, context)

    async def _list_models_raw(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _parse(pb.ListModelsRequest, raw)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None  # not reached: abort() raises
        return await self.ListModels(request, context)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        rid = request.request_id
        try:
            check_model(self._router, request.model)
        except RouterError as exc:
            await _abort(context, exc, rid)
            return  # not reached: abort() raises
        try:
            req = request_from_proto(request, context.time_remaining())
            await check_structured(req, structured_field(request.params))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                public_message(ErrorKind.INVALID, str(exc), rid))
            return  # not reached
        await context.send_initial_metadata(((REQUEST_ID_KEY, req.request_id),))
        req.trace = trace_headers(dict(context.invocation_metadata() or ()))
        stream = self._router.generate(req)
        error: RouterError | None = None
        try:
            while True:
                # Only the router's own failures are caught here; a failed write
                # or a cancellation propagates (after the stream is closed below).
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except RouterError as exc:
                    error = exc
                    break
                except Exception:
                    logger.exception("router failed on request %s", req.request_id)
                    error = RouterError(ErrorKind.INTERNAL, "internal error")
                    break
                await context.write(response_from_item(item))
        finally:
            await close_stream(stream, req.request_id)
        if error is not None:
            await _abort(context, error, req.request_id)

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        models = [
            pb.Model(id=m.id, max_model_len=m.max_model_len, owned_by=m.owned_by)
            for m in self._router.models()
        ]
        return pb.ListModelsResponse(models=models)


async def _abort(context: grpc.aio.ServicerContext, error: RouterError, request_id: str) -> None:
    trailing: tuple[tuple[str, str], ...] = ()
    if error.kind is ErrorKind.OVERLOADED and error.retry_after_s is not None:
        trailing = ((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"),)
    await context.abort(STATUS_OF[error.kind],
                        public_message(error.kind, error.message, request_id),
                        trailing_metadata=trailing)


HEALTH_PREFIX = "/grpc.health.v1.Health/"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries ``authorization: Bearer <key>``; the
    health service is open unless ``protect_probes``. Runs before the request is
    read, so an unauthenticated call never reaches a handler."""

    def __init__(self, keys: ApiKeys, protect_probes: bool = False):
        self._keys = keys
        self._protect_probes = protect_probes

        async def deny(request: bytes, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key (metadata authorization: "
                                "Bearer <key>)")

        # Status-only replies look the same on the wire for every call type.
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith(HEALTH_PREFIX) and not self._protect_probes:
            return await continuation(details)
        metadata = details.invocation_metadata or ()
        given = next((v for k, v in metadata if k == "authorization"), None)
        if isinstance(given, str) and self._keys.accepts_header(given):
            return await continuation(details)
        return self._deny


async def _update_health(router: RouterLike, health: health_aio.HealthServicer) -> None:
    try:
        ready = router.ready()
    except Exception:
        logger.exception("router.ready() failed; reporting NOT_SERVING")
        ready = False
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if ready
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for service in ("", SERVICE_NAME):  # "" = the whole server
        await health.set(service, status)


async def _health_loop(
    router: RouterLike, health: health_aio.HealthServicer, server: grpc.aio.Server, every_s: float
) -> None:
    # wait_for_termination(timeout) returns True on timeout, False once the server stopped.
    while await server.wait_for_termination(every_s):
        await _update_health(router, health)


async def start_grpc_server(
    router: RouterLike, host: str, port: int, *, health_interval_s: float = 1.0,
    api_keys: ApiKeys | None = None, protect_probes: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """Start serving Generation + Health on ``host:port`` (0 = ephemeral); with
    ``api_keys``, every call but health checks (all, with ``protect_probes``) needs one.

    Returns the started server and the bound port. Stop it with ``await server.stop(grace)``;
    the health updater ends with it.
    """
    if not health_interval_s > 0:
        raise ValueError(f"health_interval_s must be > 0, got {health_interval_s}")
    # No SO_REUSEPORT: a second server on a taken port must fail, not share it silently.
    interceptors = [ApiKeyInterceptor(api_keys, protect_probes)] if api_keys else []
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    servicer = GenerationServicer(router)
    server.add_generic_rpc_handlers((servicer.handler(),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)

    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises on bind failure; older versions return 0
        raise RuntimeError(f"gRPC server could not bind {address}: {exc}") from exc
    if bound == 0:
        raise RuntimeError(f"gRPC server could not bind {address}")

    await _update_health(router, health)  # correct from the first Check
    await server.start()
    servicer.health_task = asyncio.create_task(
        _health_loop(router, health, server, health_interval_s), name="grpc-health"
    )
    return server, bound
