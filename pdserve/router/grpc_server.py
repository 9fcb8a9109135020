"""The router's gRPC front door: ``pdserve.v1.Generation`` plus ``grpc.health.v1``.

This module owns the mapping between the wire (``protos/pdserve/v1/pdserve.proto``)
and the router's front-boundary types (``router/types.py``): proto request ->
``GenerateRequest`` (sampling parameters validated by ``SamplingParams``), chunks
-> ``GenerateResponse`` messages, ``RouterError`` kinds -> gRPC status codes, and
the health status (SERVING only while ``router.ready()``, re-read periodically).

Cancellation rule: whatever ends an RPC early (client cancel, gRPC deadline, a
closed stream) ends the handler task, and the handler then closes the router's
stream (``aclose()``), which is how the router learns to abort the request on its
workers. Responses are written with ``context.write`` from one coroutine (not
yielded) so this close is deterministic rather than left to garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos import pb, pb_grpc
from pdserve.router.api_common import (
    REQUEST_ID_KEY,
    RouterLike,
    check_model,
    close_stream,
    new_request_id,
)
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    RouterError,
    StreamChunk,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"
RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED: seconds, like HTTP
# REQUEST_ID_KEY (api_common): initial metadata of Generate, the id the router used
__all__ = ["REQUEST_ID_KEY", "RETRY_AFTER_KEY", "SERVICE_NAME", "GenerationServicer",
           "RouterLike", "start_grpc_server"]

STATUS_OF = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

# SamplingParameters fields that are proto3 `optional`: copied only when set, so
# SamplingParams' own defaults apply otherwise (max_tokens 16 is not proto's 0).
_OPTIONAL_PARAMS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logprobs",
)
# StageTimings fields sent as `<name>_s` (tpot is derived, sent too).
_TIMING_FIELDS = (
    "router_queue",
    "prefill_queue",
    "prefill",
    "kv_transfer",
    "decode_queue",
    "ttft",
    "e2e",
)


def sampling_params_from_proto(params: Any) -> SamplingParams:
    """``pb.SamplingParameters`` -> validated ``SamplingParams``; ValueError names the field."""
    kwargs: dict[str, Any] = {
        name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)
    }
    return SamplingParams(
        **kwargs,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


def request_from_proto(request: Any, time_remaining: float | None) -> GenerateRequest:
    """``pb.GenerateRequest`` -> ``GenerateRequest``; ValueError on bad input.

    The deadline is the earlier of the request's ``timeout_s`` and the gRPC deadline.
    """
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is required: set one of text, chat, token_ids")
    timeouts = [time_remaining] if time_remaining is not None else []
    if request.HasField("timeout_s"):
        if not (math.isfinite(request.timeout_s) and request.timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0 and finite, got {request.timeout_s}")
        timeouts.append(request.timeout_s)
    req = GenerateRequest(
        request_id=request.request_id or new_request_id(),
        params=sampling_params_from_proto(request.params),
        timeout_s=min(timeouts) if timeouts else None,
    )
    if kind == "text":
        req.prompt = request.text
    elif kind == "chat":
        req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    else:
        req.prompt_token_ids = list(request.token_ids.ids)
    return req


def response_from_item(item: StreamChunk | FinalChunk) -> Any:
    """A router stream item -> ``pb.GenerateResponse``."""
    if isinstance(item, StreamChunk):
        logprobs = [
            pb.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in item.logprobs
        ]
        chunk = pb.TokenChunk(token_ids=item.token_ids, text=item.text, logprobs=logprobs)
        return pb.GenerateResponse(chunk=chunk)
    timings = {f"{name}_s": getattr(item.timings, name) for name in _TIMING_FIELDS}
    timings["tpot_s"] = item.timings.tpot
    final = pb.Final(
        finish_reason=item.finish_reason,
        usage=pb.Usage(
            prompt_tokens=item.usage.prompt_tokens,
            completion_tokens=item.usage.completion_tokens,
            cached_tokens=item.usage.cached_tokens,
        ),
        timings=pb.StageTimings(**{k: v for k, v in timings.items() if v is not None}),
        num_retries=item.num_retries,
    )
    if isinstance(item.stop_reason, str):
        final.stop_string = item.stop_reason
    elif isinstance(item.stop_reason, int):
        final.stop_token_id = item.stop_reason
    return pb.GenerateResponse(final=final)


class GenerationServicer:
    """Implements ``pdserve.v1.Generation`` over a router."""

    def __init__(self, router: RouterLike):
        self._router = router
        self.health_task: asyncio.Task[None] | None = None  # held here so it is never GC'd

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            check_model(self._router, request.model)
        except RouterError as exc:
            await _abort(context, exc)
            return  # not reached: abort() raises
        try:
            req = request_from_proto(request, context.time_remaining())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return  # not reached
        await context.send_initial_metadata(((REQUEST_ID_KEY, req.request_id),))

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
            await _abort(context, error)

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        models = [
            pb.Model(id=m.id, max_model_len=m.max_model_len, owned_by=m.owned_by)
            for m in self._router.models()
        ]
        return pb.ListModelsResponse(models=models)


async def _abort(context: grpc.aio.ServicerContext, error: RouterError) -> None:
    trailing: tuple[tuple[str, str], ...] = ()
    if error.kind is ErrorKind.OVERLOADED and error.retry_after_s is not None:
        trailing = ((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"),)
    await context.abort(STATUS_OF[error.kind], error.message, trailing_metadata=trailing)


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
    router: RouterLike, host: str, port: int, *, health_interval_s: float = 1.0
) -> tuple[grpc.aio.Server, int]:
    """Start serving Generation + Health on ``host:port`` (0 = ephemeral).

    Returns the started server and the bound port. Stop it with ``await server.stop(grace)``;
    the health updater ends with it.
    """
    if not health_interval_s > 0:
        raise ValueError(f"health_interval_s must be > 0, got {health_interval_s}")
    # No SO_REUSEPORT: a second server on a taken port must fail, not share it silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = GenerationServicer(router)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
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
