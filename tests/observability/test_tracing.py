"""OpenTelemetry traces (pdserve/tracing.py), sent to a real OTLP/gRPC receiver: one
request, one trace -- the client's -- with spans from the router, the prefill worker
and the decode worker covering queue, prefill, KV transfer and decode."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.cluster.cluster import Cluster
from pdserve.cluster.config import ClusterConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.observability.otlp_sink import OtlpReceiver, Received
from pdserve.router.http.app import build_app, start_http_server
from pdserve.router.router import Router, RouterConfig
from pdserve.router.trace import RequestTrace
from pdserve.router.types import FinalChunk, GenerateRequest
from pdserve.tracing import Tracing, TracingConfig, trace_headers
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.waiting import until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


def by_name(spans: list[Received]) -> dict[str, list[Received]]:
    out: dict[str, list[Received]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def check_one_trace(spans: list[Received]) -> dict[str, list[Received]]:
    """The request's spans, as the module docstring says they are."""
    named = by_name(spans)
    [request] = named["llm_request"]
    assert request.parent_id == "00f067aa0ba902b7"  # the client's span
    assert request.attributes["gen_ai.usage.completion_tokens"] == 8
    [attempt] = named["attempt"]
    assert attempt.parent_id == request.span_id and named["queue"][0].parent_id == request.span_id
    assert (attempt.attributes["pdserve.placement"], attempt.attributes["pdserve.attempt"]) == (
        "remote", 0)
    for name in ("prefill_queue", "prefill", "kv_send", "kv_receive", "decode"):
        [span] = named[name]
        assert span.parent_id == attempt.span_id, name
        assert request.start_ns <= span.start_ns <= span.end_ns
    # the prefill worker's queue ends where its prefill begins
    assert named["prefill_queue"][0].end_ns == named["prefill"][0].start_ns
    assert named["decode"][0].attributes["pdserve.output_tokens"] == 8
    return named


def test_the_clients_trace_goes_on_through_router_prefill_and_decode(
        tiny_model: Callable[[str], Path], receiver: OtlpReceiver) -> None:
    config = TracingConfig(receiver.endpoint)
    path = tiny_model("llama-gqa")
    p = PrefillWorker("prefill-0", path, EngineConfig(role="prefill", num_blocks=64), "local",
                      tracing=Tracing("pdserve-prefill", config))
    d = DecodeWorker("decode-0", path, EngineConfig(role="decode", num_blocks=64), "local",
                     tracing=Tracing("pdserve-decode", config))
    tok = p.engine.tokenizer
    assert tok is not None
    router = Router(path.name, tok, 2048, [p, d], RouterConfig(placement="static"),
                    tracing=Tracing("pdserve-router", config))

    async def main() -> FinalChunk:
        await router.start()
        try:
            async for item in router.generate(GenerateRequest(
                    "r", GREEDY, prompt_token_ids=list(range(5, 45)), trace=CLIENT)):
                if isinstance(item, FinalChunk):
                    return item
            raise AssertionError("no final chunk")
        finally:
            await router.stop()

    try:
        asyncio.run(main())
    finally:
        p.close()
        d.close()
    # (the client stopped reading at the final chunk: the request's own span ends there)
    until("the spans of all three", lambda: len(receiver.spans(TRACE_ID)) >= 8)
    named = check_one_trace(receiver.spans(TRACE_ID))
    assert {s.resource["service.name"] for s in receiver.spans(TRACE_ID)} == {
        "pdserve-router", "pdserve-prefill", "pdserve-decode"}
    assert named["prefill"][0].attributes["pdserve.prompt_tokens"] == 40


@pytest.mark.usefixtures("ray_address")
def test_a_served_request_is_one_trace_over_three_processes(
        tiny_model: Callable[[str], Path], receiver: OtlpReceiver) -> None:
    cfg = ClusterConfig.from_dict({
        "model": str(tiny_model("llama-gqa")), "transfer": "torch",
        "prefill": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 128}},
        "decode": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 128}},
        "router": {"queue_timeout_s": 60, "placement": "static"},
        "otlp_traces_endpoint": receiver.endpoint,
    })
    cluster = Cluster(cfg)
    cluster.start()

    async def main() -> dict[str, object]:
        router = cluster.make_router()
        await router.start()
        server, port = await start_http_server(
            build_app(router, router.model_name, CollectorRegistry()), "127.0.0.1", 0)
        try:
            body = json.dumps({"model": router.model_name, "prompt": [list(range(5, 45))],
                               "max_tokens": 8, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json", **CLIENT})
            return await asyncio.to_thread(
                lambda: json.loads(urllib.request.urlopen(req, timeout=60).read()))
        finally:
            await server.stop()
            await router.stop()

    try:
        answer = asyncio.run(main())
        assert answer["usage"]["completion_tokens"] == 8  # type: ignore[index]
        until("the spans of all three processes",
              lambda: {"prefill_queue", "prefill", "kv_send", "kv_receive", "decode", "llm_request"}
              <= {s.name for s in receiver.spans(TRACE_ID)}, timeout_s=60)
    finally:
        cluster.shutdown()
    named = check_one_trace(receiver.spans(TRACE_ID))
    pids = {s.resource["service.name"]: s.resource["process.pid"]
            for spans in named.values() for s in spans}
    assert len(set(pids.values())) == 3, pids  # router, prefill and decode: three processes


def test_a_request_not_sampled_sends_nothing(
        tiny_model: Callable[[str], Path], receiver: OtlpReceiver) -> None:
    tracing = Tracing("pdserve-router", TracingConfig(receiver.endpoint, sample_ratio=0.0))
    trace = RequestTrace(tracing, None, "r", "m", GREEDY, 10)
    assert trace.attempt(0) is None  # no context goes to the workers
    trace.finished(None)
    tracing.shutdown()
    assert receiver.spans() == []


def test_trace_headers_and_config() -> None:
    assert trace_headers({"traceparent": "x", "other": "y"}) == {"traceparent": "x"}
    assert trace_headers({"Accept": "*/*"}) is None
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        TracingConfig("http://127.0.0.1:4317", 1.5)
    with pytest.raises(ValueError, match="needs otlp_traces_endpoint"):
        ClusterConfig.from_dict({"trace_sample_ratio": 0.5})
    assert ClusterConfig.from_dict({}).tracing is None
