"""End to end: a real Prometheus (the repo's config and rules, 1 s intervals) scrapes
a running 1 prefill + 1 decode Ray cluster and its router through the file-SD file
while requests run; then every dashboard query and every recording rule must return
data, and the stage histograms must count every completed request once."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from pdserve.cli import top
from pdserve.cluster.cluster import Cluster
from pdserve.cluster.config import ClusterConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.observability.file_sd import FileSD, cluster_targets
from pdserve.router.metrics import RouterMetrics, metrics_text
from pdserve.router.types import FinalChunk, GenerateRequest
from tests.integration.procs import free_port
from tests.observability.conftest import DEPLOY, panels, parse_top_args, rule_outputs
from tests.waiting import until

NUM_REQUESTS = 20
MAX_TOKENS = 6
# Dashboard queries and rules that may be empty here, with the reason.
ALLOWED_EMPTY: dict[str, str] = {}
# What vLLM 0.32's dashboards (Overview, Instances, KV Cache) query that the router
# serves natively (router/vllm_metrics.py), with no rule.
_HIST = ("time_to_first_token_seconds", "inter_token_latency_seconds",
         "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
         "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens")
VLLM_NATIVE = (
    *(f"vllm:{h}_{s}" for h in _HIST for s in ("bucket", "sum", "count")),
    *(f"vllm:request_{h}_time_seconds_{s}" for h in ("prefill", "decode") for s in ("sum", "count")),
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_cached_total",
    'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}',
    'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}',
    'vllm:request_success_total{finished_reason="length"}',
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total", "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum", "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_failed_transfers_total",
    'vllm:num_requests_waiting_by_reason{reason="deferred"}',
    'vllm:engine_sleep_state{sleep_state="awake"}', "vllm:cache_config_info",
    "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
    'vllm:prompt_tokens_cached_by_source_total{source="device"}',
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
    "vllm:request_prefill_kv_computed_tokens_count",
)
ROUTER_STAGES = ("pdserve_request_queue_seconds", "pdserve_prefill_queue_seconds",
                 "pdserve_prefill_seconds", "pdserve_kv_transfer_seconds",
                 "pdserve_decode_queue_seconds", "pdserve_time_to_first_token_seconds",
                 "pdserve_time_per_output_token_seconds", "pdserve_e2e_request_latency_seconds")


def serve_metrics(registry: CollectorRegistry) -> http.server.ThreadingHTTPServer:
    """The router's registry as its HTTP API serves it (``metrics_text``): the text
    format, whose names keep vLLM's colons."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics_text(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Prometheus:
    """The Debian ``prometheus`` binary on the repo's config, in a temp folder."""

    def __init__(self, binary: str, root: Path) -> None:
        shutil.copytree(DEPLOY / "prometheus", root / "prometheus")
        config = root / "prometheus" / "prometheus.yml"
        doc = yaml.safe_load(config.read_text())
        doc["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config.write_text(yaml.safe_dump(doc))
        self.targets = FileSD(root / "prometheus" / "targets" / "pdserve.json")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (root / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_until(self, what: str, ok: Callable[[], bool], timeout_s: float = 30) -> None:
        def done() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {Path(self.log.name).read_text()}")
            return ok()

        until(what, done, timeout_s, poll_s=0.25)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def grafana_to_promql(expr: str) -> str:
    """A panel query with Grafana's variables as the dashboard's "All" would set them."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1h").replace("$model", ".*")
            .replace("$worker", ".*"))


def prompts() -> list[list[int]]:
    # Mixed lengths; a shared 32-token prefix gives the prefix cache hits.
    shared = list(range(5, 37))
    return [shared + [40 + i] * (i % 5) if i % 2 else list(range(50 + i, 50 + i + 3 + 7 * i))
            for i in range(NUM_REQUESTS)]


async def run_load(cluster: Cluster, metrics: RouterMetrics) -> list[FinalChunk]:
    router = cluster.make_router(metrics)
    await router.start()
    try:
        async def one(i: int, prompt: list[int]) -> FinalChunk:
            req = GenerateRequest(f"obs-{i}", SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                  prompt_token_ids=prompt)
            items = [item async for item in router.generate(req)]
            assert isinstance(items[-1], FinalChunk)
            return items[-1]

        # The first request alone, so its prompt blocks are cached before the others
        # (which share its prefix) arrive: prefix-cache hits are then certain.
        ps = prompts()  # odd ones share a prefix
        done = [await one(1, ps[1])]
        rest = [one(i, p) for i, p in enumerate(ps) if i != 1]
        return done + list(await asyncio.gather(*rest))
    finally:
        await router.stop()


def test_prometheus_scrapes_a_cluster_under_load(
        prometheus_bins: tuple[str, str], ray_address: str,
        tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    model = tiny_model("llama-gqa")
    cfg = ClusterConfig.from_dict({
        "model": str(model), "transfer": "torch",
        "prefill": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 256}},
        "decode": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 512}},
        # every request through the prefill worker (the KV counts below are per request)
        "router": {"queue_timeout_s": 60, "local_prefill_max_tokens": 0, "placement": "static"},
        "kv_timeout_s": 30,
    })
    cluster = Cluster(cfg)
    prom = Prometheus(prometheus_bins[1], tmp_path)
    exporter = None
    try:
        cluster.start()
        registry = CollectorRegistry()
        metrics = RouterMetrics(registry, model.name, ttft_slo_s=60.0, tpot_slo_s=10.0)
        exporter = serve_metrics(registry)
        prom.targets.update(cluster_targets(model.name, ("127.0.0.1", int(exporter.server_port)),
                                            cluster.metrics_targets()))
        prom.wait_until("Prometheus ready", prom.ready)
        prom.wait_until("3 targets up", lambda: prom.value("sum(up)") == 3)

        finals = asyncio.run(run_load(cluster, metrics))
        assert all(f.finish_reason == "length" for f in finals)
        prom.wait_until("all requests scraped", lambda: prom.value(
            "sum(pdserve_e2e_request_latency_seconds_count)") == NUM_REQUESTS)
        prom.wait_until("vLLM's names too", lambda: prom.value(
            "sum(vllm:e2e_request_latency_seconds_count)") == NUM_REQUESTS)

        def empty_queries() -> list[str]:
            empty = [f"{p['title']}: {expr}" for p in panels() for t in p["targets"]
                     if not prom.query(expr := grafana_to_promql(t["expr"]))
                     and expr not in ALLOWED_EMPTY]
            return empty + [f"rule {r}" for r in sorted(rule_outputs())
                            if not prom.query(r) and r not in ALLOWED_EMPTY] + [
                f"vLLM's {v}" for v in VLLM_NATIVE if not prom.query(v)]

        # Rate windows need two scrapes of the final values: wait for data, with a deadline.
        with contextlib.suppress(AssertionError):
            prom.wait_until("every query to have data", lambda: not empty_queries())
        empty = empty_queries()
        assert not empty, "queries without data:\n" + "\n".join(empty)

        counts = {f"sum({name}_count)": NUM_REQUESTS for name in ROUTER_STAGES} | {
            "sum(pdserve_inter_token_latency_seconds_count)": NUM_REQUESTS * (MAX_TOKENS - 1),
            "sum(pdserve_kv_transfers_total)": NUM_REQUESTS,
            'sum(pdserve_requests_total{status="length"})': NUM_REQUESTS,
            # the first token of each request comes from the prefill worker
            'sum(pdserve_engine_tokens_total{role="decode"})': NUM_REQUESTS * (MAX_TOKENS - 1),
        }
        wrong = {q: (prom.value(q), want) for q, want in counts.items() if prom.value(q) != want}
        assert not wrong, f"(got, expected): {wrong}"
        assert prom.value("sum(pdserve_prefix_cache_hits_total)") > 0
        assert prom.value('sum(pdserve_workers_in_routing{pool="decode"})') == 1
        for ratio in ("mfu", "mbu"):
            for role in ("prefill", "decode"):
                v = prom.value(f'pool:pdserve_{ratio}_ratio:rate1m{{role="{role}"}}')
                assert 0 < v < 5, (ratio, role, v)  # CPU peaks are measured, not exact

        # pdserve top reads the same endpoints from the same file.
        args = parse_top_args("--file-sd", str(prom.targets.path), "--once", "--interval", "0.2")
        assert top.run(args) == 0
    finally:
        prom.stop()
        if exporter is not None:
            exporter.shutdown()
            exporter.server_close()
        cluster.shutdown()
