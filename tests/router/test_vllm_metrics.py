"""vLLM's names on the router's /metrics (router/vllm_metrics.py): vLLM's bounds with
the SLO targets among them, each request's stages under vLLM's meanings, and the
per-engine gauges read from the workers' loads at scrape time."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry
from pytest import approx

from pdserve.engine.results import StepInfo
from pdserve.messages import WorkerLoad, WorkerMetrics
from pdserve.router.metrics import RouterMetrics
from pdserve.router.types import FinalChunk, StageTimings, Usage
from pdserve.router.vllm_metrics import TTFT_BUCKETS, token_buckets, with_targets

M = {"model_name": "tiny", "engine": "decode-0"}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**M, **labels})


def test_bounds_are_vllms_with_the_targets_among_them() -> None:
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1000)[-1] == 1000
    bounds = with_targets(TTFT_BUCKETS, 0.3, None)
    assert 0.3 in bounds and set(TTFT_BUCKETS) <= set(bounds) and list(bounds) == sorted(bounds)
    assert with_targets(TTFT_BUCKETS, 1.0) == TTFT_BUCKETS  # already a bound: once


def finished(placement: str, cached: int = 0) -> FinalChunk:
    t = StageTimings(router_queue=0.1, prefill_queue=0.2, ttft=0.5, e2e=2.5,
                     inter_token=[0.2] * 10, tokens_after_first=10, placement=placement,
                     worker="decode-0")
    return FinalChunk("length", Usage(100, 11, cached), timings=t)


def test_a_request_under_vllms_meanings() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, "tiny", ttft_slo_s=0.3, tpot_slo_s=0.25)
    metrics.observe_finished(finished("remote"))
    assert value(registry, "vllm:time_to_first_token_seconds_count") is None  # not served yet
    metrics.watch(4096, dict, 16)
    metrics.observe_finished(finished("remote"))
    metrics.observe_finished(finished("local", cached=64))
    assert value(registry, "vllm:time_to_first_token_seconds_count") == 2
    # the SLO tile's bucket: TTFT 0.5 s misses a 0.3 s target, TPOT 0.2 s meets 0.25 s
    assert value(registry, "vllm:time_to_first_token_seconds_bucket", le="0.3") == 0
    assert value(registry, "vllm:request_time_per_output_token_seconds_bucket", le="0.25") == 2
    assert value(registry, "vllm:inter_token_latency_seconds_count") == 20
    # queue: router + prefill worker; prefill: the rest of the TTFT; decode: after it
    for stage, seconds in (("queue", 0.6), ("prefill", 0.4), ("decode", 4.0), ("inference", 4.4)):
        assert value(registry, f"vllm:request_{stage}_time_seconds_sum") == approx(seconds)
    # prompt tokens by source: moved from a prefill worker, computed here, from the cache
    assert value(registry, "vllm:prompt_tokens_by_source_total",
                 source="external_kv_transfer") == 100
    assert value(registry, "vllm:prompt_tokens_by_source_total", source="local_compute") == 36
    assert value(registry, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 64
    assert value(registry, "vllm:prompt_tokens_cached_total") == 64
    assert value(registry, "vllm:prompt_tokens_cached_by_source_total", source="device") == 64
    assert value(registry, "vllm:external_prefix_cache_queries_total") == 136
    assert value(registry, "vllm:external_prefix_cache_hits_total") == 100
    assert value(registry, "vllm:request_prefill_kv_computed_tokens_sum") == 136
    assert value(registry, "vllm:prompt_tokens_total") == 200
    assert value(registry, "vllm:generation_tokens_total") == 22
    assert value(registry, "vllm:request_success_total", finished_reason="length") == 2
    assert value(registry, "vllm:request_prompt_tokens_bucket", le="100.0") == 2


def test_engine_gauges_are_the_loads_at_scrape_time() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, "tiny")
    loads: dict[str, WorkerLoad] = {}
    metrics.watch(2048, lambda: loads, 16)
    assert value(registry, "vllm:num_requests_running") is None
    loads["decode-0"] = WorkerLoad("decode-0", "decode", "i", num_running=3, num_waiting=1,
                                   num_waiting_for_kv=2, num_free_blocks=25, num_blocks=100,
                                   queued_prefill_tokens=0)
    assert value(registry, "vllm:num_requests_running") == 3
    assert value(registry, "vllm:num_requests_waiting") == 3
    assert value(registry, "vllm:kv_cache_usage_perc") == 0.75
    assert value(registry, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
    assert value(registry, "vllm:num_requests_waiting_by_reason", reason="deferred") == 2
    assert value(registry, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value(registry, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
    assert value(registry, "vllm:cache_config_info", block_size="16", num_gpu_blocks="100") == 1
    assert value(registry, "vllm:prefix_cache_hits_total") is None  # no snapshot yet
    m = WorkerMetrics("decode-0", "decode", prefix_queries=10, prefix_hits=4,
                      num_preemptions=2, spec_drafts=5, spec_draft_tokens=20,
                      spec_accepted_tokens=12)
    m.observe_step(StepInfo(1, 30, 0, 30, 0.01), 1e9, 2e6)
    m.observe_step(StepInfo(1, 1, 0, 1, 0.01), 0.0, 0.0)
    m.observe_transfer(0.02, 5000)
    m.kv_transfer_failures = 1
    loads["decode-0"] = dataclasses.replace(loads["decode-0"], metrics=m)
    assert value(registry, "vllm:prefix_cache_queries_total") == 160  # tokens: x 16
    assert value(registry, "vllm:prefix_cache_hits_total") == 64
    assert value(registry, "vllm:num_preemptions_total") == 2
    assert value(registry, "vllm:spec_decode_num_accepted_tokens_total") == 12
    assert value(registry, "vllm:iteration_tokens_total_count") == 2
    assert value(registry, "vllm:estimated_flops_per_gpu_total") == 1e9
    assert value(registry, "vllm:estimated_read_bytes_per_gpu_total") == 2e6
    assert value(registry, "vllm:iteration_tokens_total_sum") == 31
    assert value(registry, "vllm:iteration_tokens_total_bucket", le="32.0") == 2
    assert value(registry, "vllm:iteration_tokens_total_bucket", le="16.0") == 1
    # a request's KV transfer, under vLLM's NIXL names and bounds
    assert value(registry, "vllm:nixl_xfer_time_seconds_bucket", le="0.025") == 1
    assert value(registry, "vllm:nixl_xfer_time_seconds_bucket", le="0.01") == 0
    assert value(registry, "vllm:nixl_bytes_transferred_bucket", le="8192.0") == 1
    assert value(registry, "vllm:nixl_bytes_transferred_sum") == 5000
    assert value(registry, "vllm:nixl_num_failed_transfers_total") == 1
