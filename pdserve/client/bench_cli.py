"""The ``pdserve bench`` flags, and running them: config, benchmark, JSON, plots.

This module owns the command line of the load tester. Flag names follow vLLM's
``vllm bench serve`` where one exists (``--base-url``, ``--request-rate``,
``--burstiness``, ``--max-concurrency``, ``--random-input-len``, ``--goodput``,
``--percentile-metrics``, ``--metric-percentiles``, ``--save-result``,
``--result-filename``, ...), so its users' commands work here. ``--dataset`` is
also accepted as ``--dataset-name``. Exit status: 0 when some request completed,
1 when every request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from pdserve.client.bench import DATASETS, BenchConfig, BenchOutcome, run_benchmark
from pdserve.client.metrics import (
    PERCENTILE_METRICS,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
)
from pdserve.client.openai_stream import Timeouts
from pdserve.client.report import format_sweep, rate_field, save_json, sweep_row
from pdserve.client.sweep import describe_goodput, distserve_goodput
from pdserve.client.trace import FORMATS


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"rates separated by commas, got {text!r}") from exc


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``pdserve bench`` flags to `p`."""
    add_server_arguments(p)
    add_workload_arguments(p)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Where the load goes: the server and its model."""
    srv = p.add_argument_group("server")
    srv.add_argument("--base-url", default=None,
                     help="server URL, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--endpoint", default="/v1/completions",
                     help="/v1/completions (default), /v1/chat/completions or /v1/responses")
    srv.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    srv.add_argument("--tokenizer", default=None,
                     help="Hugging Face directory with tokenizer.json (default: the served "
                          "model's name as a path, then ~/.cache/pdserve/models/<name>)")
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                     help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="context length for clipping (default: /v1/models max_model_len, "
                          "else 2048)")
    srv.add_argument("--request-timeout", type=float, default=1800.0,
                     help="seconds one request may take in all (default 1800)")
    srv.add_argument("--read-timeout", type=float, default=300.0,
                     help="seconds of silence on a stream before it fails (default 300)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What load, and what is reported (``pdserve simulate`` takes these too)."""
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                      choices=DATASETS)
    data.add_argument("--dataset-path", default=None,
                      help="ShareGPT JSON, or trace file (.csv Azure, .jsonl Mooncake)")
    data.add_argument("--num-prompts", type=int, default=1000,
                      help="requests to send (trace: the window length; default 1000)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths drawn from [L*(1-r), L*(1+r)] (default 0: exact)")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one shared prefix before every random prompt")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="fixed output length (default: the answer's length)")
    data.add_argument("--trace-format", default="auto", choices=FORMATS)
    data.add_argument("--trace-time-scale", type=float, default=1.0,
                      help="multiply trace arrival times by this: 0.1 replays 10x faster")
    data.add_argument("--trace-length-scale", type=float, default=1.0,
                      help="multiply input/output lengths and the 512-token hash block by this")
    data.add_argument("--trace-start", type=int, default=0,
                      help="index of the first trace request replayed")
    data.add_argument("--seed", type=int, default=0)

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second (default inf: all at once)")
    load.add_argument("--sweep-rates", type=_rates, default=None,
                      help="comma-separated rates: one run per rate, a table and one JSON")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 steadier")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="cap on requests in flight (default: none)")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="ask for exactly the output length (default: on for random and "
                           "trace, off for sharegpt)")
    load.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature (default: the server's)")
    load.add_argument("--extra-body", type=json.loads, default=None,
                      help="JSON object merged into every request body")

    rep = p.add_argument_group("report")
    rep.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    rep.add_argument("--slo-attainment-target", type=float, default=90.0, metavar="PCT",
                     help="a sweep's DistServe goodput: the highest rate at which this %% of "
                          "requests meet every --goodput SLO (default 90)")
    rep.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                     help="metrics printed with percentiles (default ttft,tpot,itl,e2el)")
    rep.add_argument("--metric-percentiles", default="99",
                     help="comma-separated percentiles, e.g. 50,90,99 (default 99)")
    rep.add_argument("--save-result", action="store_true", help="write the result JSON")
    rep.add_argument("--result-filename", default=None,
                     help="JSON file name (implies --save-result)")
    rep.add_argument("--result-dir", default=None, help="directory for the result JSON")
    rep.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures to DIR")
    rep.add_argument("--scrape-metrics", action="store_true",
                     help="read the server's /metrics before and after: stage breakdown")
    rep.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A validated `BenchConfig` from parsed flags (ValueError on bad input)."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    extra: dict[str, Any] = dict(args.extra_body or {})
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    return BenchConfig(
        base_url=base_url.rstrip("/"), endpoint=args.endpoint, model=args.model,
        tokenizer=args.tokenizer, api_key=args.api_key or None, dataset=args.dataset,
        dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len, trace_format=args.trace_format,
        trace_time_scale=args.trace_time_scale, trace_length_scale=args.trace_length_scale,
        trace_start=args.trace_start, max_model_len=args.max_model_len,
        request_rates=args.sweep_rates or (args.request_rate,), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        goodput=parse_goodput(args.goodput),
        slo_attainment_target=args.slo_attainment_target / 100.0,
        percentile_metrics=tuple(parse_metric_names(args.percentile_metrics)),
        metric_percentiles=tuple(parse_percentiles(args.metric_percentiles)), seed=args.seed,
        extra_body=extra, scrape_metrics=args.scrape_metrics,
        timeouts=Timeouts(read=args.read_timeout, total=args.request_timeout),
        disable_tqdm=args.disable_tqdm,
    )


def result_path(args: argparse.Namespace, cfg: BenchConfig, outcome: BenchOutcome) -> Path:
    """--result-filename, else pdserve-<rate>qps[-concurrencyN]-<model>-<date>.json."""
    if args.result_filename:
        name = args.result_filename
    else:
        first = outcome.results[0]
        rate = "sweep" if cfg.is_sweep else f"{rate_field(cfg.request_rates[0])}qps"
        if cfg.dataset == "trace":
            rate = "trace"
        conc = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency else ""
        model = str(first["model_id"]).rstrip("/").split("/")[-1]
        name = f"pdserve-{rate}{conc}-{model}-{first['date']}.json"
    return Path(args.result_dir or ".") / name


def _plots(directory: Path, outcome: BenchOutcome, saved: dict[str, Any]) -> list[Path]:
    from pdserve.client.plots import plot_latency_cdfs, plot_sweep, plot_timeline

    runs = [(f"{r['request_rate']} req/s", r) for r in outcome.results]
    written = [plot_latency_cdfs(runs, directory / "latency_cdf.png")]
    if "rows" not in saved:
        written.append(plot_timeline(outcome.results[0], directory / "timeline.png"))
        return written
    for r in outcome.results:
        written.append(plot_timeline(r, directory / f"timeline_{r['request_rate']}.png"))
    written.append(plot_sweep(saved["rows"], directory / "sweep.png",
                              saved["distserve_goodput"]))
    return written


def sweep_summary(cfg: BenchConfig, outcome: BenchOutcome) -> dict[str, Any]:
    """What a sweep saves: the setup, one row per rate and the DistServe goodput."""
    rows = [sweep_row(r) for r in outcome.results]
    return {**outcome.setup, "rows": rows,
            "distserve_goodput": distserve_goodput(rows, cfg.slo_attainment_target)}


def run(args: argparse.Namespace) -> int:
    """``pdserve bench``: returns the exit status."""
    cfg = config_from_args(args)
    return report(args, cfg, asyncio.run(run_benchmark(cfg)))


def report(args: argparse.Namespace, cfg: BenchConfig, outcome: BenchOutcome) -> int:
    """A sweep's table, the result JSON and figures as asked; the exit status (0 when
    some request completed). ``pdserve simulate`` reports through it too."""
    saved = outcome.results[0]
    if cfg.is_sweep:
        saved = sweep_summary(cfg, outcome)
        print(format_sweep(saved["rows"]))
        if saved["distserve_goodput"] is not None:
            print(describe_goodput(saved["distserve_goodput"]))
    if args.save_result or args.result_filename:
        print(f"Result saved to {save_json(result_path(args, cfg, outcome), saved)}")
    if args.plot:
        for path in _plots(Path(args.plot), outcome, saved):
            print(f"Figure: {path}")
    return 0 if any(r["completed"] > 0 for r in outcome.results) else 1
