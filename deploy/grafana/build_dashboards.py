"""Writes ``dashboards/pdserve.json``: the pdserve Grafana dashboard.

Rows follow a request's path: overview -> disaggregation -> faults -> latency ->
per-stage breakdown ->
prefill pool -> KV transfer -> decode pool (with colocated workers) -> efficiency ->
per-worker drill-down. Template
variables ``model`` and ``worker`` filter every panel (``=~`` matchers, so "All"
works). Each panel's description says what it shows and what to do when it looks
wrong; ``docs/observability.md`` has the same per panel.

Run ``python deploy/grafana/build_dashboards.py`` after changing it; a test checks
that the committed JSON is what this script writes, that panel ids are unique, and
that every metric in every query exists (in the code's metric definitions or as a
recording rule's output), and the end-to-end test runs every query against a real
Prometheus scraping a cluster.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "pdserve.json"
M = 'model=~"$model"'
W = 'model=~"$model", worker=~"$worker"'
R = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    stacked: bool = False
    width: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


def quantiles(hist: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({hist}_bucket{{{selector}}}{R})))",
             f"{legend}p{round(q * 100)}") for q in QUANTILES]


def mean(hist: str, selector: str, by: str = "") -> str:
    grp = f" by ({by})" if by else ""
    return (f"sum{grp} (rate({hist}_sum{{{selector}}}{R})) / "
            f"sum{grp} (rate({hist}_count{{{selector}}}{R}))")


def rate(counter: str, selector: str, by: str = "") -> str:
    grp = f" by ({by})" if by else ""
    return f"sum{grp} (rate({counter}{{{selector}}}{R}))"


BEFORE_FIRST = (  # request-flow order; the stacked means add up to the mean TTFT
    ("router queue", "pdserve_request_queue_seconds"),
    ("prefill queue", "pdserve_prefill_queue_seconds"),
    ("prefill", "pdserve_prefill_seconds"),
)
HAND_OVER = (  # after the first token (streamed by the prefill worker)
    ("KV transfer", "pdserve_kv_transfer_seconds"),
    ("decode queue", "pdserve_decode_queue_seconds"),
)
STAGES = BEFORE_FIRST + HAND_OVER
# Token workers: decode and colocated (a colocated worker decodes too).
P, D = f'{W}, role="prefill"', f'{W}, role=~"decode|colocated"'
FAILED = ', status!~"stop|length|abort"'  # ended without an answer (errors, rejections)
MET = ', met="true"'

ROWS: list[tuple[str, list[Panel]]] = [
    ("Overview", [
        Panel("Request rate by status", "Requests ended per second, by finish reason or rejection kind. "
              "Rising overloaded/timeout: the decode pool has no free KV blocks or the router queue is "
              "full: add decode workers or lower max_tokens.",
              [(rate("pdserve_requests_total", M, "status"), "{{status}}")], "reqps"),
        Panel("Error ratio", "Share of ended requests that did not finish with stop/length/abort. "
              "Non-zero: read the router log for the failing stage; check KV transfer failures below.",
              [(f"({rate('pdserve_requests_total', M + FAILED)} or vector(0))"
                f" / {rate('pdserve_requests_total', M)}", "errors")], "percentunit"),
        Panel("Token throughput", "Prompt and generated tokens per second of finished requests.",
              [(rate("pdserve_prompt_tokens_total", M), "prompt"),
               (rate("pdserve_generation_tokens_total", M), "generation")], "short"),
        Panel("Goodput", "Finished requests per second that met both the TTFT and the TPOT SLO "
              "(needs both `serve --ttft-slo-ms` and `--tpot-slo-ms`, or ttft_slo_ms / "
              "tpot_slo_ms in the YAML). Falls while request rate holds: see SLO attainment "
              "and the per-stage breakdown.",
              [(rate("pdserve_slo_requests_total", M + ', slo="both", met="true"'), "goodput")], "reqps"),
        Panel("SLO attainment", "Share of finished requests meeting each SLO. TTFT misses: look at "
              "queue/prefill stages; TPOT misses: decode batch size and decode step time.",
              [(f"{rate('pdserve_slo_requests_total', M + MET, 'slo')}"
                f" / {rate('pdserve_slo_requests_total', M, 'slo')}", "{{slo}}")], "percentunit"),
        Panel("SLO attainment over the dashboard's range", "Share of the finished requests of "
              "the whole time range meeting each target (ttft, tpot, both): the number to "
              "compare with an SLO's objective. Empty: no --ttft-slo-ms / --tpot-slo-ms.",
              [(f"sum by (slo) (increase(pdserve_slo_requests_total{{{M}{MET}}}[$__range]))"
                f" / sum by (slo) (increase(pdserve_slo_requests_total{{{M}}}[$__range]))",
                "{{slo}}")], "percentunit", extra={"type": "stat", "options": {
                    "reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value",
                    "graphMode": "none", "textMode": "value_and_name"}}),
    ]),
    ("Disaggregation", [
        Panel("Where prompts are computed", "Attempts per second by where their prompt ran: "
              "remote (a prefill worker, KV moved), local (the decode worker itself) or "
              "colocated. The router decides per request from the workers' measured step "
              "times, their queues and the SLOs (docs/disaggregation.md).",
              [(rate("pdserve_prompt_placements_total", M, "where"), "{{where}}")], "reqps",
              stacked=True),
        Panel("Placement decisions by reason", "Why each prompt went where it did: "
              "faster_here / within_ttft_slo / cached_suffix (local), protects_tpot / "
              "faster_remote (remote), static / unmeasured (the rule off or not yet "
              "measured). Mostly protects_tpot under load: decode is busy, prefill pays.",
              [(rate("pdserve_prompt_placements_total", M, "where, reason"),
                "{{where}} {{reason}}")], "reqps"),
        Panel("Cores per worker (phase sharing)", "CPU threads each worker's last step ran on: "
              "workers that share a node lend their cores while idle (core_sharing: phase). "
              "Steps per second run on borrowed cores, and seconds per second an owner waited "
              "for its cores back (should stay near 0).",
              [("sum by (worker) (pdserve_engine_threads{" + W + "})", "{{worker}} threads"),
               (rate("pdserve_core_borrowed_steps_total", W, "worker"), "{{worker}} borrowed steps/s"),
               (rate("pdserve_core_wait_seconds_total", W, "worker"), "{{worker}} wait s/s")]),
    ]),
    ("Faults", [
        Panel("Failed attempts by reason", "Request attempts that failed on a worker per second, by "
              "reason (timeout, peer_died, worker_died, unhealthy, ...). Each was retried on another "
              "worker or, past the retry budget, ended in an error. Steady timeouts: a decode worker "
              "is too slow for kv_timeout_s; worker_died: see restarts.",
              [(rate("pdserve_failed_attempts_total", M, "reason"), "{{reason}}")], "ops"),
        Panel("Retries", "Requests moved to another prefill/decode pair after a failure. Non-zero: "
              "a worker died or a transfer failed.",
              [(rate("pdserve_request_retries_total", M), "retries")], "reqps"),
        Panel("Worker restarts", "Workers that came back with a new process (Ray restarted them) "
              "per hour. Repeated restarts of one worker: read its actor log (OOM, crash).",
              [("sum by (worker) (increase(pdserve_worker_restarts_total{" + M + "}[1h]))",
                "{{worker}}")], "short"),
        Panel("Workers in routing", "Workers of each pool the router sends requests to. Below the "
              "configured count: a worker died, failed its health probes, or is restarting.",
              [('sum by (pool) (pdserve_workers_in_routing{' + M + '})', "{{pool}}")], "short"),
    ]),
    ("Latency", [
        Panel("Time to first token", "Router: arrival to first token.",
              quantiles("pdserve_time_to_first_token_seconds", M), "s", width=6),
        Panel("Time per output token", "Router: mean gap after the first token, per request.",
              quantiles("pdserve_time_per_output_token_seconds", M), "s", width=6),
        Panel("Inter-token latency", "Router: every gap between tokens. p99 far above p50: "
              "decode steps stalled (preemption, long steps, a slow poll).",
              quantiles("pdserve_inter_token_latency_seconds", M), "s", width=6),
        Panel("End-to-end latency", "Router: arrival to the final token.",
              quantiles("pdserve_e2e_request_latency_seconds", M), "s", width=6),
    ]),
    ("Per-stage breakdown", [
        Panel("Mean time per stage (stacked)", "Mean seconds a request spends in each stage before "
              "its first token; the stack is about the mean TTFT. The largest band is the bottleneck.",
              [(mean(h, M), name) for name, h in BEFORE_FIRST], "s", stacked=True, width=8),
        Panel("Hand-over (after the first token)", "Mean seconds of the KV hand-over that follow "
              "the first token (the prefill worker streams it): the last send until acknowledged, "
              "then until the decode worker's first step. They delay the second token.",
              [(mean(h, M), name) for name, h in HAND_OVER], "s", stacked=True, width=8),
        Panel("p90 per stage", "90th percentile of each stage (not additive).",
              [(q[0], name) for name, h in STAGES for q in quantiles(h, M)[1:2]], "s", width=8),
    ]),
    ("Prefill pool", [
        Panel("Prefill tokens/s", "Prompt tokens computed per second per prefill worker.",
              [(rate("pdserve_engine_tokens_total", P, "worker"), "{{worker}}")]),
        Panel("Prefill queue", "Prompt tokens not yet computed and requests waiting per worker. "
              "Growing: add prefill workers or raise max_num_batched_tokens.",
              [("sum by (worker) (pdserve_queued_prefill_tokens{" + P + "})", "{{worker}} tokens"),
               ("sum by (worker) (pdserve_num_requests_waiting{" + P + "})", "{{worker}} requests")]),
        Panel("Prefix cache hit ratio", "Prompt blocks found in the prefix cache / looked up.",
              [(f'{rate("pdserve_prefix_cache_hits_total", P, "worker")} / '
                f'{rate("pdserve_prefix_cache_queries_total", P, "worker")}', "{{worker}}")],
              "percentunit"),
        Panel("Prefill step time", "Engine step time (forward + sampling) on the prefill pool.",
              quantiles("pdserve_engine_step_seconds", P), "s"),
        Panel("Prefill tokens per step", "Tokens per prefill step; far below max_num_batched_tokens "
              "under load: requests arrive too slowly to fill steps.",
              quantiles("pdserve_batch_tokens", P)),
        Panel("Prefill busy fraction", "Fraction of wall time spent in engine steps; near 1: saturated.",
              [("sum by (worker) (rate(pdserve_engine_step_seconds_sum{" + P + "}" + R + "))",
                "{{worker}}")], "percentunit"),
    ]),
    ("KV transfer", [
        Panel("KV transfer bandwidth", "KV bytes per second sent by each prefill worker.",
              [(rate("pdserve_kv_transfer_bytes_total", P, "worker"), "{{worker}}")], "Bps"),
        Panel("KV transfer latency", "Router: send started until acknowledged, per request. High "
              "with low bandwidth: the channel is slow (wrong backend, TCP instead of RDMA).",
              quantiles("pdserve_kv_transfer_seconds", M), "s"),
        Panel("KV transfers and failures", "Transfers completed and failed per second. Failures: "
              "check the decode worker's kv_timeout_s and the transfer backend's logs.",
              [(rate("pdserve_kv_transfers_total", W), "completed"),
               (rate("pdserve_kv_transfer_failures_total", W), "failed")], "ops"),
        Panel("KV in flight", "Blocks held by prefill workers for unacknowledged sends; requests "
              "holding decode blocks while their KV is on the way.",
              [("sum by (worker) (pdserve_kv_blocks_in_flight{" + P + "})", "{{worker}} blocks"),
               ("sum by (worker) (pdserve_num_requests_waiting_for_kv{" + D + "})",
                "{{worker}} requests")]),
        Panel("KV bytes per request", "KV bytes the prefill worker sent per request: only "
              "the blocks the decode worker did not hold already.",
              quantiles("pdserve_kv_transfer_request_bytes", M), "bytes"),
        Panel("Decode prefix reuse", "Share of prompt blocks each decode worker held already "
              "(its prefix cache: a conversation's earlier turns are not sent again). Low on "
              "multi-turn traffic: the router spread a conversation over decode workers.",
              [(f'{rate("pdserve_prefix_cache_hits_total", D, "worker")} / '
                f'{rate("pdserve_prefix_cache_queries_total", D, "worker")}', "{{worker}}")],
              "percentunit"),
        Panel("Local prefills", "Requests per second a decode worker prefilled itself: it held "
              "all but a short suffix of the prompt (a conversation's next turn), so no "
              "prefill worker took part and no KV moved (router local_prefill_max_tokens).",
              [(rate("pdserve_local_prefills_total", D, "worker"), "{{worker}}")], "reqps"),
        Panel("Per-transfer throughput", "Bytes per second while transfers are busy (bytes / summed "
              "transfer seconds): the channel's effective speed.",
              [(f'{rate("pdserve_kv_transfer_bytes_total", P, "worker")} / '
                f'{rate("pdserve_kv_transfer_busy_seconds_total", P, "worker")}', "{{worker}}")], "Bps"),
    ]),
    ("Decode pool (and colocated workers)", [
        Panel("Decode batch size", "Mean sequences per decode step, and running requests.",
              [(mean("pdserve_batch_size", D, "worker"), "{{worker}} mean batch"),
               ("sum by (worker) (pdserve_num_requests_running{" + D + "})", "{{worker}} running")]),
        Panel("KV cache usage", "Fraction of each decode worker's KV blocks in use. Near 1 with "
              "preemptions: add decode workers or KV memory.",
              [("sum by (worker) (pdserve_kv_cache_usage_ratio{" + D + "})", "{{worker}}")],
              "percentunit"),
        Panel("Preemptions", "Requests preempted (recomputed) per second; should stay 0.",
              [(rate("pdserve_num_preemptions_total", D, "worker"), "{{worker}}")], "ops"),
        Panel("Decode step time", "Decode step time; sets TPOT. Rising with batch size is expected; "
              "rising alone: the device is shared or throttled.",
              quantiles("pdserve_engine_step_seconds", D), "s"),
        Panel("Decode tokens/s", "Tokens generated per second per decode worker.",
              [(rate("pdserve_engine_tokens_total", D, "worker"), "{{worker}}")]),
        Panel("Decode waiting", "Requests waiting for a decode slot (not KV).",
              [("sum by (worker) (pdserve_num_requests_waiting{" + D + "})", "{{worker}}")]),
        Panel("Speculative decoding", "Draft tokens accepted / proposed (acceptance), and "
              "tokens each speculating step gave (accepted per draft + 1). Acceptance near 0: "
              "the workload copies little; speculation pauses itself, or turn it off.",
              [(f'{rate("pdserve_spec_decode_num_accepted_tokens_total", D, "worker")} / '
                f'{rate("pdserve_spec_decode_num_draft_tokens_total", D, "worker")}',
                "{{worker}} acceptance"),
               (f'1 + {rate("pdserve_spec_decode_num_accepted_tokens_total", D, "worker")} / '
                f'{rate("pdserve_spec_decode_num_drafts_total", D, "worker")}',
                "{{worker}} tokens per step")]),
    ]),
    ("Efficiency", [
        Panel("Prefill MFU", "Model FLOPs utilisation of the prefill pool while busy (should be "
              "high: prefill is compute-bound). Low: chunks too small, or attention backend slow.",
              [('pool:pdserve_mfu_ratio:rate1m{model=~"$model", role="prefill"}', "pool"),
               ('worker:pdserve_mfu_ratio:rate1m{' + P + '}', "{{worker}}")], "percentunit"),
        Panel("Decode MBU", "Memory bandwidth utilisation of the decode pool while busy (should be "
              "high: decode is bandwidth-bound). Low: small batches dominated by overheads.",
              [('pool:pdserve_mbu_ratio:rate1m{model=~"$model", role="decode"}', "pool"),
               ('worker:pdserve_mbu_ratio:rate1m{' + D + '}', "{{worker}}")], "percentunit"),
        Panel("MFU and MBU per worker", "Both ratios for every worker, with the busy fraction.",
              [('worker:pdserve_mfu_ratio:rate1m{' + W + '}', "{{worker}} MFU"),
               ('worker:pdserve_mbu_ratio:rate1m{' + W + '}', "{{worker}} MBU"),
               ('worker:pdserve_engine_busy_ratio:rate1m{' + W + '}', "{{worker}} busy")],
              "percentunit"),
    ]),
    ("Per-worker drill-down", [
        Panel("Requests per worker", "Running and waiting requests of the selected workers.",
              [("sum by (worker) (pdserve_num_requests_running{" + W + "})", "{{worker}} running"),
               ("sum by (worker) (pdserve_num_requests_waiting{" + W + "})", "{{worker}} waiting")]),
        Panel("KV usage per worker", "KV block usage of the selected workers.",
              [("sum by (worker) (pdserve_kv_cache_usage_ratio{" + W + "})", "{{worker}}")],
              "percentunit"),
        Panel("Step time p90 per worker", "90th percentile step time of each selected worker.",
              quantiles("pdserve_engine_step_seconds", W, "worker")[1:2], "s"),
        Panel("Tokens/s per worker", "Tokens computed per second by each selected worker.",
              [(rate("pdserve_engine_tokens_total", W, "worker"), "{{worker}}")]),
        Panel("Batch tokens p50 per worker", "Median tokens per step of each selected worker.",
              quantiles("pdserve_batch_tokens", W, "worker")[:1]),
        Panel("Device peaks", "Peak FLOP/s and bandwidth used for MFU/MBU (datasheet or measured).",
              [("sum by (worker) (pdserve_device_peak_flops{" + W + "})", "{{worker}} FLOP/s"),
               ("sum by (worker) (pdserve_device_peak_bytes_per_second{" + W + "})",
                "{{worker}} B/s")]),
    ]),
]


def _variables() -> list[dict[str, Any]]:
    def query(name: str, q: str) -> dict[str, Any]:
        return {"name": name, "label": name, "type": "query", "datasource": DATASOURCE,
                "query": {"query": q, "refId": name}, "definition": q, "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"text": "All", "value": "$__all"}, "sort": 1}

    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        query("model", "label_values(pdserve_num_requests_running, model)"),
        query("worker", 'label_values(pdserve_num_requests_running{model=~"$model"}, worker)'),
    ]


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {"fillOpacity": 60 if p.stacked else 10, "lineWidth": 1}
    if p.stacked:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": pid, "type": "timeseries", "title": p.title, "description": p.description,
        "datasource": DATASOURCE, "gridPos": {"x": x, "y": y, "w": p.width, "h": 8},
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": DATASOURCE} for i, (expr, legend) in enumerate(p.targets)],
        **p.extra,
    }


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for p in row:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    return {
        "uid": "pdserve-overview", "title": "pdserve", "tags": ["pdserve", "llm"],
        "description": "Prefill/decode disaggregated serving, in request-flow order.",
        "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": 39,
        "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": _variables()}, "annotations": {"list": []}, "links": [],
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
