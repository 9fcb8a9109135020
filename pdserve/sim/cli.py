"""``pdserve simulate``: ``pdserve bench``'s workload and report flags, ``pdserve
serve``'s deployment flags (or ``--config``, the same YAML), and where step times
come from -- run on the virtual clock instead of a cluster. Prints and saves what
``pdserve bench`` does (the same result JSON), with a ``simulation`` section."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

from pdserve.client.bench import BenchConfig, BenchOutcome
from pdserve.client.bench_cli import add_workload_arguments, config_from_args, report
from pdserve.client.report import format_result
from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.planner.step_times import (
    AnalyticModel,
    Profile,
    StepTimes,
    resolve_hardware,
    resolve_model_config,
)
from pdserve.sim.deployment import (
    DEFAULT_OVERHEADS,
    DEFAULT_STEP_OVERHEAD_S,
    build,
    with_overheads,
)
from pdserve.sim.link import LINKS, Link, get_link
from pdserve.sim.run import simulate
from pdserve.sim.workers import StepScale
from pdserve.sim.workload import offered_rate, plan

SIMULATED = "http://simulated"  # the result JSON's base_url
PROFILE_MAX_MODEL_LEN = 2048  # a profile's run without --max-model-len (as pdserve bench)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The simulator's own flags, and ``pdserve bench``'s workload and report flags
    (the deployment flags are ``pdserve serve``'s, added by the caller)."""
    g = p.add_argument_group("step times")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--profile", action="append", default=None, metavar="FILE",
                     help="step times measured on the target machine (pdserve plan "
                          "--measure-profile); repeat it for several thread counts: each "
                          "pool steps as the one of its workers' threads (one profile: "
                          "every pool)")
    src.add_argument("--hardware", default=None, metavar="NAME",
                     help="the analytic model on this device: h100, h200, a100, b200 (and "
                          "-pcie/-nvl), or cpu (measured here); with --model a preset "
                          "(llama-3-8b, llama-3-70b, ...) or a model directory")
    g.add_argument("--mfu", type=float, default=None, help="--hardware: prefill MFU (default 0.5)")
    g.add_argument("--mbu", type=float, default=None, help="--hardware: decode MBU (default 0.8)")
    g.add_argument("--link", default=None, choices=sorted(LINKS),
                   help="KV transfer link (default: infiniband on GPUs; on the CPU the "
                        "deployment's transfer backend as measured here)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest request (default: the model's context; with --profile 2048)")
    g.add_argument("--tokenizer", default=None,
                   help="--dataset sharegpt: a directory with tokenizer.json (default: "
                        "the model's)")
    g.add_argument("--overheads-ms", default=None, metavar="K=MS,...",
                   help="the router's and workers' own costs, milliseconds: request (before "
                        "admission), call (router to a worker, one way), token (relay of "
                        "one), step (a worker loop's per step); default: small guesses, "
                        f"not measurements ({_format_overheads()}): benchmarks/simulate.py "
                        "calibrates them against served runs")
    g.add_argument("--step-time-scale", default="1", metavar="X|prefill=X,decode=Y",
                   help="served steps take X times the step model's (default 1; more where "
                        "the router and the client share the workers' cores), or per kind: "
                        "a step's prompt tokens and its decoding rows")
    g.add_argument("--link-latency-ms", type=float, default=None,
                   help="the link's latency per send (overrides --link's)")
    g.add_argument("--link-bandwidth-gbs", type=float, default=None,
                   help="the link's bandwidth per rank, GB/s (overrides --link's)")
    g.add_argument("--exact-steps", action="store_true",
                   help="simulate every step one by one (slower; the same results)")
    add_workload_arguments(p)
    p.set_defaults(base_url=SIMULATED, endpoint="/v1/completions", api_key=None,
                   request_timeout=math.inf, read_timeout=math.inf, host=None, port=None)


def run(args: argparse.Namespace, cluster: ClusterConfig) -> int:
    cfg = config_from_args(args)
    steps_for, device, model, max_len = step_source(args, cluster)
    link = get_link(args.link or ("infiniband" if device == "gpu" else f"{cluster.transfer}-cpu"))
    if args.link_latency_ms is not None or args.link_bandwidth_gbs is not None:
        link = Link(f"{link.name} (given)",
                    link.bandwidth if args.link_bandwidth_gbs is None else args.link_bandwidth_gbs * 1e9,
                    link.latency_s if args.link_latency_ms is None else args.link_latency_ms / 1e3,
                    link.per_block_s)
    deployment = replace(build(cluster, steps_for, device, link, max_len),
                         step_scale=StepScale.parse(args.step_time_scale))
    if args.overheads_ms:
        deployment = with_overheads(deployment, args.overheads_ms)
    print(f"Simulating {deployment.describe()}; step times: "
          f"{steps_for(cluster.decode).describe()}", flush=True)
    lengths = (_sharegpt_lengths(args, cfg, args.model or cluster.model or model, max_len)
               if cfg.dataset == "sharegpt" else None)
    setup: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "pdserve-simulate",
        "endpoint": cfg.endpoint, "base_url": SIMULATED, "model_id": model,
        "num_prompts": cfg.num_prompts, "dataset_name": cfg.dataset,
        "dataset_path": cfg.dataset_path, "max_model_len": max_len,
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "ignore_eos": True, "goodput_config": dict(cfg.goodput) or None,
    }
    results = []
    for rate in cfg.request_rates:
        planned = plan(cfg, rate, max_len, lengths)
        setup["num_prompts"] = len(planned)
        shown = offered_rate(planned) if cfg.dataset == "trace" else rate
        result = simulate(deployment, planned, cfg, shown, setup, fast=not args.exact_steps)
        print(format_result(result, cfg.percentile_metrics, cfg.metric_percentiles))
        sim = result["simulation"]
        print(f"simulated {sim['simulated_s']:.1f} s in {sim['wall_s']:.2f} s "
              f"({sim['events']} events); prompts computed: {sim['placement']}", flush=True)
        results.append(result)
    return report(args, cfg, BenchOutcome(results, setup))


def step_source(args: argparse.Namespace, cluster: ClusterConfig,
                 ) -> tuple[Callable[[PoolConfig], StepTimes], str, str, int]:
    """(step times of a pool's worker, "cpu" | "gpu", the model's name, max model len)."""
    if args.profile:
        profiles = {}
        for path in args.profile:
            prof = Profile.load(path)
            profiles[prof.threads] = prof
        first = next(iter(profiles.values()))

        def from_profile(pool: PoolConfig) -> StepTimes:
            if pool.workers and pool.tensor_parallel_size > 1:
                raise ValueError("a profile measures one worker of one rank: simulate "
                                 "tensor-parallel pools with --hardware")
            if len(profiles) == 1:
                return first
            threads = pool.engine_config("decode", first.device).num_threads or 1
            if threads not in profiles:
                raise ValueError(f"no profile of {threads} thread(s) (a pool's workers' "
                                 f"threads); given: {sorted(profiles)}")
            return profiles[threads]

        return (from_profile, first.device, first.model,
                args.max_model_len or PROFILE_MAX_MODEL_LEN)
    if not args.hardware:
        raise ValueError("step times: give --profile FILE (pdserve plan --measure-profile) "
                         "or --hardware NAME with --model")
    mc = resolve_model_config(args.model or cluster.model or "SmolLM2-135M-Instruct")
    hw = resolve_hardware(args.hardware)
    kwargs = {k: v for k, v in (("mfu", args.mfu), ("mbu", args.mbu)) if v is not None}

    def analytic(pool: PoolConfig) -> StepTimes:
        dtype = str(pool.engine.get("dtype", "auto"))
        return AnalyticModel(mc, hw, tp=pool.tensor_parallel_size,
                             dtype="bfloat16" if dtype == "auto" else dtype,
                             quantization=str(pool.engine.get("quantization", "none")),
                             **kwargs)

    device = "cpu" if args.hardware.lower() == "cpu" else "gpu"
    return analytic, device, mc.name or str(args.model), \
        args.max_model_len or mc.max_position_embeddings


def _sharegpt_lengths(args: argparse.Namespace, cfg: BenchConfig, model: str,
                      max_len: int) -> list[tuple[int, int]]:
    from pdserve.client.datasets import sharegpt_requests
    from pdserve.client.tokens import PromptTokenizer, resolve_tokenizer_dir

    assert cfg.dataset_path is not None
    tok = PromptTokenizer.from_dir(resolve_tokenizer_dir(args.tokenizer, model))
    reqs = sharegpt_requests(tok, cfg.dataset_path, cfg.num_prompts, max_len,
                             cfg.sharegpt_output_len, cfg.seed)
    return [(r.prompt_len, r.expected_output_len) for r in reqs]


def _format_overheads() -> str:
    o = DEFAULT_OVERHEADS
    return (f"request={o.request_s * 1e3:g},call={o.call_s * 1e3:g},token={o.token_s * 1e3:g},"
            f"step={DEFAULT_STEP_OVERHEAD_S * 1e3:g}")
