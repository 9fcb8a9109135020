"""The worker collector: step histograms recorded in ``WorkerMetrics``, exported as
Prometheus histograms; counters, gauges, labels, the MFU/MBU window; and the real
prefill/decode/colocated workers filling them (in-process, local transfer): from the
first scrape on, and answering while busy."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import EngineConfig
from pdserve.engine.results import StepInfo
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import STEP_SECONDS_BUCKETS, WorkerMetrics, bucket_samples
from pdserve.observability import worker_metrics
from pdserve.observability.efficiency import DevicePeaks
from pdserve.observability.worker_metrics import WorkerCollector, serve_worker_metrics
from pdserve.router.types import FinalChunk, GenerateRequest
from pdserve.worker.colocated import ColocatedWorker
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.inprocess import Pair
from tests.observability.conftest import PEAKS, worker_registry
from tests.waiting import until_async

LABEL_KEYS = {"model", "role", "worker"}


def step(seconds: float, seqs: int = 1, tokens: int = 1) -> StepInfo:
    return StepInfo(num_seqs=seqs, num_tokens=tokens, num_decode=seqs, context_tokens=10 * seqs,
                    seconds=seconds)


def samples(stats: WorkerMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(worker_registry(stats)).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_observe_step_buckets_by_upper_bound() -> None:
    s = WorkerMetrics("p", "prefill", 0, 0, 0, 8)
    first = STEP_SECONDS_BUCKETS[0]
    for seconds in (first, first * 1.01, 1e9):  # on a bound, just above it, above all
        s.observe_step(step(seconds), 0.0, 0.0)
    assert s.step_seconds_buckets[0] == 1 and s.step_seconds_buckets[1] == 1
    assert s.step_seconds_buckets[-1] == 1 and sum(s.step_seconds_buckets) == 3
    assert s.steps == 3 and s.step_seconds == pytest.approx(first * 2.01 + 1e9)
    before = s.batch_size_buckets
    s.observe_step(step(0.01, seqs=3, tokens=700), 5.0, 7.0)
    assert before is not s.batch_size_buckets  # replaced, never mutated: snapshots stay put
    assert s.seqs_computed == 6 and s.tokens_computed == 703
    assert s.model_flops == 5.0 and s.memory_bytes_read == 7.0


def test_bucket_samples_are_cumulative() -> None:
    assert bucket_samples((1.0, 2.0), (1, 0, 2)) == [("1.0", 1.0), ("2.0", 1.0), ("+Inf", 3.0)]


def test_exported_histograms_counters_and_labels() -> None:
    stats = WorkerMetrics("decode-0", "decode", 3, 2, 32, 128, kv_transfer_seconds=1.5,
                        kv_transfer_bytes=4096, num_preemptions=2)
    for seconds in (0.002, 0.004, 0.5):
        stats.observe_step(step(seconds, seqs=4, tokens=4), 1e9, 2e8)
    got = samples(stats)
    buckets = got["pdserve_engine_step_seconds_bucket"]
    values = [v for _, v in buckets]
    assert values == sorted(values) and values[-1] == 3  # cumulative, +Inf = count
    assert got["pdserve_engine_step_seconds_count"][0][1] == 3
    assert got["pdserve_engine_step_seconds_sum"][0][1] == pytest.approx(0.506)
    assert got["pdserve_batch_size_sum"][0][1] == 12
    assert got["pdserve_kv_transfer_busy_seconds_total"][0][1] == 1.5
    assert "pdserve_kv_transfer_seconds_total" not in got  # the router's histogram's name
    assert got["pdserve_num_preemptions_total"][0][1] == 2
    assert got["pdserve_kv_cache_usage_ratio"][0][1] == pytest.approx(1 - 32 / 128)
    assert got["pdserve_device_peak_flops"][0][1] == PEAKS.flops_per_s
    # busy seconds 0.506 at 1e9 FLOPs per step: 3e9 / 0.506 / peak
    assert got["pdserve_mfu_ratio"][0][1] == pytest.approx(3e9 / 0.506 / PEAKS.flops_per_s)
    extra = {"le"}, {"device", "source", "tensor_parallel_size"}
    for name, rows in got.items():
        for labels, _ in rows:
            assert labels["worker"] == "decode-0" and labels["role"] == "decode", name
            assert set(labels) - LABEL_KEYS in (set(), *extra), (name, labels)


def test_ratio_gauges_cover_the_recent_window() -> None:
    stats = WorkerMetrics("p", "prefill", 0, 0, 0, 8)
    collector = WorkerCollector("tiny", lambda: stats, PEAKS, window_s=0.0)

    def mfu() -> float:
        return next(m for m in collector.collect() if m.name == "pdserve_mfu_ratio").samples[0].value

    stats.observe_step(step(1.0), 1e12, 0.0)  # 100% of the peak
    assert mfu() == pytest.approx(1.0)
    stats.observe_step(step(1.0), 0.5e12, 0.0)
    assert mfu() == pytest.approx(0.5)  # only the step since the last scrape
    assert mfu() == 0.0  # no step in the window


def test_tensor_parallel_worker_divides_by_all_its_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP=2 worker's peaks are two devices': the same whole-model FLOPs are half the
    MFU of one device's, and the info gauge says how many ranks."""
    stats = WorkerMetrics("p", "prefill", 0, 0, 0, 8)
    stats.observe_step(step(1.0), 1e12, 1e11)
    got = {}
    for peaks in (PEAKS, PEAKS.times(2)):
        collector = WorkerCollector("tiny", lambda: stats, peaks, window_s=0.0)
        got[peaks.ranks] = {m.name: m.samples[0] for m in collector.collect()}
    assert got[1]["pdserve_mfu_ratio"].value == pytest.approx(1.0)
    assert got[2]["pdserve_mfu_ratio"].value == pytest.approx(0.5)
    assert got[2]["pdserve_mbu_ratio"].value == pytest.approx(0.5)
    assert got[2]["pdserve_device_peak_flops"].value == 2 * PEAKS.flops_per_s
    assert got[2]["pdserve_device_info"].labels["tensor_parallel_size"] == "2"
    assert got[1]["pdserve_device_info"].labels["tensor_parallel_size"] == "1"
    # The worker's server looks its peaks up for all its ranks.
    asked: list[int] = []

    def detect(dtype: str = "float32", ranks: int = 1) -> DevicePeaks:
        asked.append(ranks)
        return PEAKS.times(ranks)

    monkeypatch.setattr(worker_metrics, "detect_peaks", detect)
    assert serve_worker_metrics("tiny", lambda: stats, tensor_parallel_size=2) > 0
    assert asked == [2]


def test_real_workers_fill_step_statistics(tiny_model: Callable[[str], Path]) -> None:
    pair = Pair(tiny_model("llama-gqa"), decode_blocks=64)

    async def main() -> None:
        await pair.router.start()
        try:
            for i, n in enumerate((5, 40)):
                req = GenerateRequest(f"r{i}", SamplingParams(max_tokens=4, ignore_eos=True),
                                      prompt_token_ids=list(range(5, 5 + n)))
                items = [item async for item in pair.router.generate(req)]
                assert isinstance(items[-1], FinalChunk)
            # Both workers idle now: their next loop pass publishes the final snapshot.
            # (P counts a transfer when its send completes, which also answers the
            # router's hand-off: the request can end before P's next snapshot has it.)
            await until_async("idle workers' snapshots", lambda: all(
                w.metrics().steps and not w.metrics().num_running for w in pair.workers)
                and pair.prefill[0].metrics().kv_transfers == 2)
        finally:
            await pair.router.stop()

    try:
        asyncio.run(main())
        p, d = pair.prefill[0].metrics(), pair.decode[0].metrics()
        assert p.steps >= 2 and p.tokens_computed == 45 and p.model_flops > 0
        assert sum(p.step_seconds_buckets) == p.steps == sum(p.batch_tokens_buckets)
        assert p.kv_transfers == 2 and p.kv_transfer_bytes > 0
        assert d.steps >= 3 and d.tokens_computed == d.seqs_computed  # one token per decode
        assert d.memory_bytes_read > 0 and sum(d.batch_size_buckets) == d.steps
        text = generate_latest(worker_registry(d)).decode()
        assert "r0" not in text and "r1" not in text  # never a request id
    finally:
        pair.close()


def test_a_new_worker_shows_its_free_blocks_from_the_first_scrape(
        tiny_model: Callable[[str], Path]) -> None:
    """Scraped right after it is built, before its loop's first pass (which waits
    for work up to a second): the engine's free blocks, not 0."""
    model = tiny_model("llama-gqa")
    builders: list[Callable[[], PrefillWorker | DecodeWorker | ColocatedWorker]] = [
        lambda: PrefillWorker("prefill-0", model, EngineConfig(role="prefill", num_blocks=24)),
        lambda: DecodeWorker("decode-0", model, EngineConfig(role="decode", num_blocks=24)),
        lambda: ColocatedWorker("colocated-0", model,
                                EngineConfig(role="colocated", num_blocks=24)),
    ]
    for build in builders:
        w = build()
        try:
            got = samples(w.metrics())
            assert got["pdserve_kv_blocks_free"][0][1] == w.engine.stats().num_free_blocks > 0
            assert got["pdserve_kv_blocks_capacity"][0][1] == w.engine.num_blocks
            assert got["pdserve_kv_cache_usage_ratio"][0][1] == pytest.approx(
                1 - w.engine.stats().num_free_blocks / w.engine.num_blocks)
        finally:
            w.close()


def test_metrics_answer_while_the_engine_is_busy(tiny_model: Callable[[str], Path]) -> None:
    """/metrics and the health probe read the last published snapshots: a worker
    whose engine is stuck in a long step still answers both at once."""
    pair = Pair(tiny_model("llama-gqa"))
    gate = threading.Event()
    w = pair.decode[0]
    try:
        before = w.metrics()
        w.loop.call(gate.wait)  # the loop thread is busy until the gate opens
        text = generate_latest(worker_registry(w.metrics())).decode()
        assert "pdserve_kv_blocks_free" in text
        load = asyncio.run(asyncio.wait_for(w.load(), timeout=5))
        assert load.worker_id == "decode-0" and w.metrics() is before
    finally:
        gate.set()
        pair.close()
