"""The router's gRPC front door: ``pdserve.v1.Generation`` plus ``grpc.health.v1``.

This module owns the mapping between the wire (``protos/pdserve/v1/pdserve.proto``)
and the router's front-boundary types (``router/types.py``): proto request ->
``GenerateRequest`` (sampling parameters validated by ``SamplingParams``), chunks
-> ``GenerateResponse`` messages, ``RouterError`` kinds -> gRPC status codes, and
the health status (SERVING only while ``router.ready()``, re-read periodically).

Sampling parameters beyond the scalar ones: ``logit_bias`` (a map), ``priority``,
vLLM's token controls (``allowed_token_ids``, ``skip_special_tokens``, ``cache_salt``;
on the request ``bad_words`` and ``truncate_prompt_tokens``), and the ``structured``
oneof (``json_schema`` as JSON text, ``json_object``, ``regex``, ``choice``,
``grammar``, ``structural_tag`` as JSON text) -> ``StructuredOutput``. A constraint is compiled
(``api.common.compile_constraints``, at most ``STRUCTURED_COMPILE_TIMEOUT_S``) before the
request reaches the router, so a bad schema is INVALID_ARGUMENT naming the field
and nothing is queued for it.

A chat prompt takes vLLM's chat extras (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` as JSON text), checked by the same
rule as HTTP's (``openai.chat_messages.ChatTemplateFields.template_args``).

The request's ``prediction`` oneof (OpenAI's predicted outputs): text, which the router
tokenizes, or token ids -> ``params.prediction``; ``Usage`` then carries the drafted
prediction tokens accepted and rejected.

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
import json
import logging
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutput
from pdserve.protos import pb
from pdserve.router.api.common import (
    REQUEST_ID_KEY,
    ConstraintRefused,
    RouterLike,
    check_model,
    checked_request_id,
    compile_constraints,
    one_line,
)
from pdserve.router.api.keys import ApiKeys
from pdserve.router.api.public_errors import public_message
from pdserve.router.api.router_stream import close_stream
from pdserve.router.openai.chat_messages import ChatTemplateFields
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    RouterError,
    StreamChunk,
)
from pdserve.tracing import trace_headers

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"
RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED: seconds, like HTTP
# Longest a structured-output constraint may take to compile before it is refused
# (INVALID_ARGUMENT); the OpenAI HTTP API bounds its check the same way.
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
    "skip_special_tokens",
    "cache_salt",
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
    """``pb.SamplingParameters`` -> validated ``SamplingParams``; ValueError names the field.

    The structured-output constraint is built but not compiled here (see
    ``check_structured``)."""
    kwargs: dict[str, Any] = {
        name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)
    }
    return SamplingParams(
        **kwargs,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=tuple(params.logit_bias.items()),  # validated and sorted there
        priority=params.priority,
        structured=structured_from_proto(params),
        allowed_token_ids=tuple(params.allowed_token_ids),
    )


def structured_from_proto(params: Any) -> StructuredOutput | None:
    """The ``structured`` oneof -> ``StructuredOutput`` (None: unset, or json_object
    false); ValueError names the field."""
    kind = params.WhichOneof("structured")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None
    try:
        if kind in ("json_schema", "structural_tag"):
            try:
                spec = json.loads(getattr(params, kind), parse_constant=_no_constant)
            except ValueError as exc:  # JSONDecodeError, and numbers past Python's limits
                raise ValueError(f"not valid JSON: {exc}") from None
            return (StructuredOutput.json_schema(spec) if kind == "json_schema"
                    else StructuredOutput.structural_tag(spec))
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "regex":
            return StructuredOutput.regex(params.regex)
        if kind == "choice":
            return StructuredOutput.choice(list(params.choice.choices))
        return StructuredOutput.grammar(params.grammar)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise ValueError(f"{kind}: {one_line(str(exc))}") from None


def _json_object(field: str, text: str) -> dict[str, Any] | None:
    """A JSON object given as text (empty: None); ValueError naming ``field``."""
    if not text:
        return None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{field}: not valid JSON: {one_line(str(exc))}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _structured_field(params: Any) -> str:
    return params.WhichOneof("structured") or "structured"


async def check_structured(req: GenerateRequest, field: str) -> None:
    """Compile ``req.params.structured`` (``api.common.compile_constraints``); ValueError
    naming ``field`` if it is invalid or too slow to compile."""
    structured = req.params.structured
    if structured is None:
        return
    try:
        await compile_constraints([(field, structured)])
    except ConstraintRefused as exc:
        if exc.limit_s is None:
            raise ValueError(str(exc)) from None
        raise ValueError(f"{field}: the constraint took longer than {exc.limit_s:g} s to "
                         f"compile; simplify it") from None


def request_from_proto(request: Any, time_remaining: float | None) -> GenerateRequest:
    """``pb.GenerateRequest`` -> ``GenerateRequest``; ValueError on bad input.

    The deadline is the earlier of the request's ``timeout_s`` and the gRPC deadline.
    """
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is required: set one of text, chat, token_ids")
    req = GenerateRequest(
        request_id=checked_request_id(request.request_id or None),
        params=sampling_params_from_proto(request.params),
        timeout_s=request.timeout_s if request.HasField("timeout_s") else None,
    )
    if kind == "text":
        req.prompt = request.text
    elif kind == "chat":
        req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    else:
        req.prompt_token_ids = list(request.token_ids.ids)
    template = [f for f, given in (
        ("add_generation_prompt", request.HasField("add_generation_prompt")),
        ("continue_final_message", request.continue_final_message),
        ("chat_template_kwargs", bool(request.chat_template_kwargs))) if given]
    if template:
        if kind != "chat":
            raise ValueError(f"{template[0]} needs a chat prompt")
        req.chat_template_args = ChatTemplateFields(
            add_generation_prompt=(request.add_generation_prompt
                                   if request.HasField("add_generation_prompt") else True),
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=_json_object("chat_template_kwargs",
                                              request.chat_template_kwargs)).template_args()
    predicted = request.WhichOneof("prediction")
    if predicted == "prediction_text":
        req.prediction = request.prediction_text
    elif predicted == "prediction_token_ids":
        req.params = replace(req.params, prediction=tuple(request.prediction_token_ids.ids))
    if request.HasField("truncate_prompt_tokens"):
        req.truncate_prompt_tokens = request.truncate_prompt_tokens
    req.bad_words = tuple(request.bad_words)
    if (problem := req.problem()) is not None:  # the router's rules, before the deadline
        raise ValueError(problem[1])
    if time_remaining is not None:  # the gRPC deadline, when earlier (past: ends at once)
        left = max(time_remaining, 1e-6)
        req.timeout_s = min(req.timeout_s or left, left)
    return req


def _prediction_usage(counts: tuple[int, int] | None) -> dict[str, int]:
    if counts is None:
        return {}
    return {"accepted_prediction_tokens": counts[0], "rejected_prediction_tokens": counts[1]}


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
    timings: dict[str, float | str | None] = {
        f"{name}_s": getattr(item.timings, name) for name in _TIMING_FIELDS}
    timings["tpot_s"] = item.timings.tpot
    timings["placement"] = item.timings.placement
    timings["placement_reason"] = item.timings.placement_reason
    final = pb.Final(
        finish_reason=item.finish_reason,
        usage=pb.Usage(
            prompt_tokens=item.usage.prompt_tokens,
            completion_tokens=item.usage.completion_tokens,
            cached_tokens=item.usage.cached_tokens,
            **_prediction_usage(item.usage.prediction_tokens),
        ),
        timings=pb.StageTimings(**{k: v for k, v in timings.items() if v is not None},
                                spec_draft_tokens=item.timings.spec_draft_tokens,
                                spec_accepted_tokens=item.timings.spec_accepted_tokens),
        num_retries=item.num_retries,
    )
    if isinstance(item.stop_reason, str):
        final.stop_string = item.stop_reason
    elif isinstance(item.stop_reason, int):
        final.stop_token_id = item.stop_reason
    return pb.GenerateResponse(final=final)


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
            await check_structured(req, _structured_field(request.params))
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
