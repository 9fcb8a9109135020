"""OpenTelemetry traces: one trace per request, across the router, the prefill worker
and the decode worker.

Off unless a deployment names an OTLP endpoint (``--otlp-traces-endpoint``, vLLM's
flag; YAML ``otlp_traces_endpoint``): then every process of it -- the router and each
worker -- exports its own spans to that endpoint (OTLP over gRPC, or HTTP/protobuf
with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, as vLLM reads it), batched
off the serving threads. A request's trace continues the client's W3C ``traceparent``
(HTTP header or gRPC metadata) or starts one, ``trace_sample_ratio`` of them (a
continued trace keeps the client's decision); the router hands each attempt's
context to the workers with the request (``Carrier``: the W3C headers), so their
spans join it.

Spans, each on its own process's clock:

* router: ``llm_request`` (server span: arrival to the end, with vLLM's ``gen_ai.*``
  attributes), ``queue`` (arrival to admitted), one ``attempt`` per attempt (its
  workers, where its prompt was computed and why, the failure that ended it);
* prefill worker: ``prefill_queue`` (received to first scheduled), ``prefill`` (first
  scheduled to first token), ``kv_send`` (the last send to the decode worker's
  acknowledgement);
* decode worker: ``kv_receive`` (reserved to KV arrived) or, for a prompt it computed
  itself, ``prefill``; ``decode`` (the first token to the end);
* colocated worker: ``prefill`` and ``decode``.

Workers record the wall-clock times of those events as they pass and make the
spans when the request leaves them (``Tracing.span`` with explicit times), so a
traced request costs a few dictionary writes per stage, nothing per token.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdserve.tracing")

Carrier = dict[str, str]  # W3C trace context headers: traceparent (and tracestate)
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
EXPORT_EVERY_MS = 1000  # a process's finished spans go out at least this often


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str  # OTLP collector, e.g. http://127.0.0.1:4317
    sample_ratio: float = 1.0  # of the traces the router starts (a client's is kept as sent)

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if not self.endpoint:
            raise ValueError("otlp_traces_endpoint must not be empty")


def trace_headers(headers: Mapping[str, str]) -> Carrier | None:
    """A client's W3C trace context from its HTTP headers or gRPC metadata."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


def now_ns() -> int:
    return time.time_ns()


class Tracing:
    """One process's tracer, exporting to the deployment's OTLP endpoint."""

    def __init__(self, service: str, config: TracingConfig,
                 attributes: Mapping[str, str] | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service, "process.pid": os.getpid(),
                                    "host.name": socket.gethostname(), **(attributes or {})})
        self._provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        self._provider.add_span_processor(BatchSpanProcessor(
            _exporter(config.endpoint), schedule_delay_millis=EXPORT_EVERY_MS))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self.kinds = {"server": SpanKind.SERVER, "internal": SpanKind.INTERNAL}
        self.config = config

    def context(self, carrier: Carrier | None) -> Any:
        return self._propagator.extract(carrier or {})

    def carrier(self, span: Any) -> Carrier | None:
        """The W3C headers that make a span the parent of spans elsewhere (None when
        it is not recorded: nothing downstream records either)."""
        if not span.is_recording():
            return None
        from opentelemetry.trace import set_span_in_context

        out: Carrier = {}
        self._propagator.inject(out, context=set_span_in_context(span))
        return out

    def start(self, name: str, parent: Carrier | Any | None, attributes: Mapping[str, Any],
              start_ns: int | None = None, kind: str = "internal") -> Any:
        """A span open until its ``end()`` (``parent``: a carrier, or a span)."""
        context = self._parent(parent)
        return self._tracer.start_span(name, context=context, kind=self.kinds[kind],
                                       attributes=dict(attributes), start_time=start_ns)

    def span(self, name: str, parent: Carrier | None, start_ns: int, end_ns: int,
             attributes: Mapping[str, Any]) -> None:
        """A span that happened (from the event times a worker noted)."""
        if parent is None:
            return
        span = self.start(name, parent, attributes, start_ns)
        span.end(end_time=max(start_ns, end_ns))

    def _parent(self, parent: Carrier | Any | None) -> Any:
        if parent is None or isinstance(parent, dict):
            return self.context(parent)
        from opentelemetry.trace import set_span_in_context

        return set_span_in_context(parent)

    def shutdown(self) -> None:
        """Export what is left (at most a few seconds), then stop."""
        self._provider.shutdown()


def _exporter(endpoint: str) -> Any:
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: grpc or http/protobuf")


class Marks:
    """A request's event times on one worker, and the context its spans join: what its
    spans are made of (``span``) as the request passes and leaves."""

    def __init__(self, tracing: Tracing, carrier: Carrier, worker_id: str) -> None:
        self._tracing = tracing
        self._carrier = carrier
        self._worker = worker_id
        self.at: dict[str, int] = {"start": now_ns()}

    def mark(self, event: str, ago_s: float = 0.0) -> None:
        """``event`` happened now (or ``ago_s`` seconds ago); its first time is kept."""
        self.at.setdefault(event, now_ns() - int(ago_s * 1e9))

    def span(self, name: str, start: str, end: str | None = None, **attributes: Any) -> None:
        """The span ``name`` from event ``start`` to event ``end`` (now, if None)."""
        if start not in self.at:
            return
        stop = self.at.get(end, now_ns()) if end is not None else now_ns()
        self._tracing.span(name, self._carrier, self.at[start], stop,
                           {"pdserve.worker": self._worker,
                            **{f"pdserve.{k}": v for k, v in attributes.items()
                               if v is not None}})
