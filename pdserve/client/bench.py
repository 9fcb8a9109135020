"""One benchmark (or a sweep of request rates) against an OpenAI-compatible server.

This module owns `BenchConfig` (every setting of ``pdserve bench``, validated once)
and `run_benchmark`, which puts the pieces together: ask the server for its model
and context length, load the tokenizer, build the dataset, then per request rate
scrape ``/metrics``, send the requests, scrape again, compute the figures and print
the result block. Saving and plotting are the caller's (`bench_cli`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.client.datasets import SampleRequest, random_requests, sharegpt_requests
from pdserve.client.metrics import calculate_metrics
from pdserve.client.openai_stream import (
    CHAT_COMPLETIONS,
    OpenAIStreamClient,
    RequestOutput,
    Timeouts,
)
from pdserve.client.report import build_result, format_result, rate_field
from pdserve.client.request_runner import RunSpec, arrival_offsets, run_requests, trace_offsets
from pdserve.client.server_metrics import placements, stage_breakdown
from pdserve.client.sweep import DEFAULT_ATTAINMENT_TARGET
from pdserve.client.tokens import PromptTokenizer, resolve_tokenizer_dir
from pdserve.client.trace import TraceOptions, load_trace, trace_requests

DATASETS = ("random", "sharegpt", "trace")
DEFAULT_MAX_MODEL_LEN = 2048  # when neither --max-model-len nor /v1/models tells


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one ``pdserve bench`` invocation (see `bench_cli` for each flag)."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: first of /v1/models
    tokenizer: str | None = None  # None: the served model's directory
    api_key: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    trace_format: str = "auto"
    trace_time_scale: float = 1.0
    trace_length_scale: float = 1.0
    trace_start: int = 0
    max_model_len: int | None = None  # None: the server's, else 2048
    request_rates: tuple[float, ...] = (math.inf,)  # more than one: a sweep
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool | None = None  # None: on for random and trace, off for sharegpt
    goodput: Mapping[str, float] = field(default_factory=dict)  # SLO name -> ms
    slo_attainment_target: float = DEFAULT_ATTAINMENT_TARGET  # a sweep's DistServe goodput
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    metric_percentiles: tuple[float, ...] = (99.0,)
    seed: int = 0
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    scrape_metrics: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.dataset in ("sharegpt", "trace") and not self.dataset_path:
            raise ValueError(f"--dataset {self.dataset} needs --dataset-path")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rates or any(r <= 0 for r in self.request_rates):
            raise ValueError("request rates must be > 0 (or inf)")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.dataset == "trace" and self.is_sweep:
            raise ValueError("--sweep-rates does not apply to trace replay "
                             "(its arrival times come from the trace; use --trace-time-scale)")
        if not 0 < self.slo_attainment_target <= 1:
            raise ValueError(f"--slo-attainment-target must be in (0, 100], "
                             f"got {100 * self.slo_attainment_target:g}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, "
                             f"got {self.base_url!r}")

    @property
    def is_sweep(self) -> bool:
        return len(self.request_rates) > 1

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith(CHAT_COMPLETIONS.removeprefix("/v1"))

    @property
    def effective_ignore_eos(self) -> bool:
        return self.ignore_eos if self.ignore_eos is not None else self.dataset != "sharegpt"


@dataclass
class BenchOutcome:
    """What `run_benchmark` returns: one result per request rate, in order."""

    results: list[dict[str, Any]]
    setup: dict[str, Any]


async def _server_model(client: OpenAIStreamClient, cfg: BenchConfig) -> tuple[str, int | None]:
    """(model name, context length the server reports or None)."""
    try:
        models = await client.list_models()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        if cfg.model is not None:
            return cfg.model, None  # the server may not list models; the name is given
        raise ValueError(f"cannot list models at {client.base_url}/v1/models: {exc}") from exc
    except ValueError:
        if cfg.model is not None:
            return cfg.model, None
        raise
    if cfg.model is None and not models:
        raise ValueError(f"{client.base_url}/v1/models lists no model; pass --model")
    chosen = next((m for m in models if m.get("id") == cfg.model), None) if cfg.model else models[0]
    name = cfg.model or str(models[0]["id"])
    max_len = (chosen or {}).get("max_model_len")
    return name, int(max_len) if isinstance(max_len, int) and max_len > 0 else None


def load_requests(cfg: BenchConfig, tok: PromptTokenizer, max_model_len: int) -> list[SampleRequest]:
    if cfg.dataset == "random":
        return random_requests(tok, cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                               cfg.random_range_ratio, cfg.random_prefix_len, cfg.seed)
    assert cfg.dataset_path is not None  # checked by BenchConfig
    if cfg.dataset == "sharegpt":
        return sharegpt_requests(tok, cfg.dataset_path, cfg.num_prompts, max_model_len,
                                 cfg.sharegpt_output_len, cfg.seed)
    opts = TraceOptions(time_scale=cfg.trace_time_scale, length_scale=cfg.trace_length_scale,
                        max_model_len=max_model_len, start=cfg.trace_start,
                        num_prompts=cfg.num_prompts, seed=cfg.seed)
    return trace_requests(tok, load_trace(cfg.dataset_path, cfg.trace_format), opts)


def _log(message: str) -> None:
    print(message, flush=True)


async def run_benchmark(cfg: BenchConfig) -> BenchOutcome:
    """Run every request rate of `cfg` in turn; prints progress and result blocks."""
    async with OpenAIStreamClient(cfg.base_url, cfg.api_key, cfg.timeouts,
                                  max_connections=cfg.max_concurrency or 0) as client:
        model, server_len = await _server_model(client, cfg)
        max_model_len = cfg.max_model_len or server_len or DEFAULT_MAX_MODEL_LEN
        tok_dir = resolve_tokenizer_dir(cfg.tokenizer, model)
        tok = PromptTokenizer.from_dir(tok_dir)
        _log(f"Model: {model}   tokenizer: {tok_dir}   max model len: {max_model_len}")
        requests = load_requests(cfg, tok, max_model_len)
        _log(f"Dataset: {cfg.dataset}, {len(requests)} requests, "
             f"{sum(r.prompt_len for r in requests)} prompt tokens")
        setup: dict[str, Any] = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": ("openai-responses" if cfg.endpoint.rstrip("/").endswith("/responses")
                        else "openai-chat" if cfg.is_chat else "openai"),
            "endpoint": cfg.endpoint,
            "base_url": cfg.base_url,
            "model_id": model,
            "tokenizer_id": str(tok_dir),
            "num_prompts": len(requests),
            "dataset_name": cfg.dataset,
            "dataset_path": cfg.dataset_path,
            "max_model_len": max_model_len,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency,
            "ignore_eos": cfg.effective_ignore_eos,
            "goodput_config": dict(cfg.goodput) or None,
        }
        if cfg.dataset == "trace":
            setup.update(trace_time_scale=cfg.trace_time_scale,
                         trace_length_scale=cfg.trace_length_scale, trace_start=cfg.trace_start)
        spec = RunSpec(cfg.endpoint, model, cfg.effective_ignore_eos, cfg.max_concurrency,
                       cfg.extra_body)
        results = []
        for rate in cfg.request_rates:
            result = await _one_rate(client, cfg, spec, requests, rate, tok)
            result = {**setup, **result}
            _log(format_result(result, cfg.percentile_metrics, cfg.metric_percentiles))
            results.append(result)
        return BenchOutcome(results, setup)


async def _one_rate(client: OpenAIStreamClient, cfg: BenchConfig, spec: RunSpec,
                    requests: list[SampleRequest], rate: float,
                    tok: PromptTokenizer) -> dict[str, Any]:
    if cfg.dataset == "trace":
        offsets = trace_offsets(requests)
        span = offsets[-1] - offsets[0]
        rate = (len(offsets) - 1) / span if span > 0 else math.inf
        _log(f"Trace replay: {len(requests)} requests over {span:.1f} s "
             f"(mean {rate:.2f} req/s)")
    else:
        offsets = arrival_offsets(len(requests), rate, cfg.burstiness, cfg.seed)
        kind = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
        _log(f"Traffic request rate: {rate}\nBurstiness factor: {cfg.burstiness} ({kind})")
    _log(f"Maximum request concurrency: {cfg.max_concurrency}")
    before = await client.get_text("/metrics") if cfg.scrape_metrics else None
    bar = tqdm(total=len(requests), disable=cfg.disable_tqdm, file=sys.stderr,
               desc=f"{rate_field(rate)} req/s" if cfg.is_sweep else "requests")

    def done(out: RequestOutput) -> None:
        if out.success and not out.usage_reported:
            out.output_tokens = len(tok.encode(out.generated_text))  # no usage: count text
        bar.update(1)

    try:
        outputs, duration = await run_requests(client, requests, offsets, spec, done)
    finally:
        bar.close()
    metrics = calculate_metrics(outputs, duration, cfg.metric_percentiles, cfg.goodput)
    result = build_result(metrics, outputs, duration, {"request_rate": rate_field(rate)})
    if cfg.scrape_metrics:
        after = await client.get_text("/metrics")
        if after is None:
            _log(f"warning: no /metrics at {cfg.base_url}; server breakdown skipped")
        result["server_metrics"] = stage_breakdown(before, after)
        result["server_placements"] = placements(before, after)
    return result
