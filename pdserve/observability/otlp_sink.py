"""An OTLP/gRPC trace receiver: the collector's TraceService on a loopback port,
keeping every span it is sent (with its resource's attributes). What the tracing
tests check traces against, and where ``benchmarks.tracing`` sends them."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Received:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _values(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[Received], lock: threading.Lock) -> None:
        self.sink, self.lock = sink, lock

    def Export(self, request: Any, context: Any) -> Any:  # the proto's name
        got = []
        for rs in request.resource_spans:
            resource = _values(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Received(s.name, s.trace_id.hex(), s.span_id.hex(),
                                        s.parent_span_id.hex(), s.start_time_unix_nano,
                                        s.end_time_unix_nano, _values(s.attributes), resource))
        with self.lock:
            self.sink.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[Received] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Service(self._spans, self._lock), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    def spans(self, trace_id: str | None = None) -> list[Received]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def close(self) -> None:
        self._server.stop(grace=None)
