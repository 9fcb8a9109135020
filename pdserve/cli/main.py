"""The ``pdserve`` command line: ``generate``, ``serve``, ``bench``, ``top``, ``plan``,
``scale``, ``workers``, ``down``, ``model prepare``, ``model make-tiny``.

Each subcommand parses its flags here and calls into the package that owns the
work; errors in user input print one clear line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.cluster.config import ClusterConfig


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run one prompt through the engine and print the result")
    p.add_argument("--model", default=None,
                   help="model directory or name (default: SmolLM2-135M-Instruct, prepared on first use)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token")
    _add_format_flags(p, per_pool=False)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the engine")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--disaggregated", action="store_true",
                   help="run through a fresh 1 prefill + 1 decode cluster")
    p.add_argument("--transfer", default=None, help="KV transfer backend with --disaggregated")
    p.set_defaults(func=cmd_generate)


def _add_format_flags(p: argparse.ArgumentParser, per_pool: bool) -> None:
    """Weights' dtype and quantization (engine keys; YAML sets them per pool)."""
    p.add_argument("--dtype", default=None,
                   help="auto (default: bfloat16 where the fast kernels run, else float32) | "
                        "float32 (exact parity with transformers) | bfloat16")
    p.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "w8a8"],
                   help="quantization of the linear layers (default none): int8 / int4 "
                        "weight-only (the default model serves its GGUF blocks natively), "
                        "or w8a8 (int8 weights x int8 activations, for compute-bound "
                        "prefill; docs/quantization.md)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="int4 group: 32 (default), 64 or 128")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8"],
                   help="the KV cache's format: auto (default: as --dtype) or int8 (a scale "
                        "per token and head: 1.88x the tokens in the same memory; every "
                        "pool, as the hand-off needs both ends alike; docs/kv_transfer.md)")
    p.add_argument("--speculative-config", type=_json_mapping, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
                        "(the decode and colocated pools, and a draft model the prefill pool "
                        "too; docs/speculative-decoding.md)")
    if per_pool:
        for pool in ("prefill", "decode"):
            p.add_argument(f"--{pool}-quantization", default=None,
                           choices=["none", "int8", "int4", "w8a8"],
                           help=f"the {pool} pool's own quantization (overrides --quantization)")
    else:
        p.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="ranks the engine is split over, one process each (default 1)")
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{pool}-tensor-parallel-size", type=int, default=None,
                       help=f"ranks per {pool} worker (default 1; the pool's "
                            f"tensor_parallel_size)" + (" with --disaggregated" if not per_pool
                                                       else ""))


def _json_mapping(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """What is deployed (``pdserve serve`` and ``pdserve simulate``): pools, transfer,
    routing, placement, SLOs, formats; or ``--config``, the same YAML."""
    p.add_argument("--model", default=None, help="model directory or name (default model)")
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--decode-workers", type=int, default=None)
    p.add_argument("--colocated-workers", type=int, default=None,
                   help="workers doing both phases (default 0; each gets the CPUs of one "
                        "prefill + one decode worker)")
    p.add_argument("--transfer", default=None, help="nixl | torch | ray | local (default nixl)")
    p.add_argument("--policy", default=None,
                   help="routing: least_loaded | prefix_affinity | round_robin")
    p.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                   help="a decode worker holding all but N tokens of a prompt in its prefix "
                        "cache (a conversation's next turn) computes them itself, no KV "
                        "moved (default 64; 0: always a prefill worker)")
    p.add_argument("--placement", choices=("measured", "static"), default=None,
                   help="where each prompt is computed: measured (default) -- per request, "
                        "a prefill worker or the decode worker itself, from measured costs, "
                        "queues and the SLOs; static -- a prefill worker (but for the rule "
                        "above)")
    p.add_argument("--config", default=None, help="YAML cluster config (flags override it)")
    p.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="TTFT target: the SLO metrics, and the placement rule's target")
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="TPOT target: the SLO metrics, and what the placement rule keeps "
                        "decode workers' running requests within")
    _add_format_flags(p, per_pool=True)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start prefill/decode pools and the router")
    _add_deployment_flags(p)
    p.add_argument("--grpc-port", type=int, default=None, help="default 50051")
    p.add_argument("--http-port", type=int, default=None, help="default 8000")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join: auto | ray://host:port (default: embedded)")
    p.add_argument("--deployment", default=None, metavar="NAME",
                   help="with --address: the workers outlive this router (named, detached "
                        "actors); a router started with the same NAME re-attaches to them, "
                        "and several may serve them at once (pdserve down stops them)")
    p.add_argument("--log-level", choices=("debug", "info", "warning"), default="info",
                   help="the server's log (debug: every placement decision, with what it "
                        "predicted)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on HTTP and gRPC")
    p.add_argument("--api-key-file", default=None,
                   help="file of accepted keys, one per line (with or without --api-key)")
    p.add_argument("--protect-probes", action="store_true", default=None,
                   help="the key guards /health, /metrics and grpc.health.v1 too")
    p.add_argument("--file-sd", default=None,
                   help="write a Prometheus file-SD targets file here (kept current)")
    p.add_argument("--shutdown-timeout", type=float, default=None, dest="shutdown_timeout_s",
                   metavar="S", help="on SIGTERM/SIGINT, stop admitting and give requests in "
                                     "flight this long to finish (default 30; a second signal "
                                     "stops at once)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces (router, prefill and decode spans of each "
                        "request) to this OTLP collector (gRPC; OTEL_EXPORTER_OTLP_TRACES_"
                        "PROTOCOL=http/protobuf for HTTP), as vLLM's flag")
    p.add_argument("--trace-sample-ratio", type=float, default=None, metavar="R",
                   help="share of new traces recorded (default 1; a client's traceparent "
                        "keeps its own decision)")
    p.add_argument("--autoscale", action="store_true", default=None,
                   help="size the prefill/decode pools to the load at runtime, to meet "
                        "--ttft-slo-ms and --tpot-slo-ms (both needed; docs/planner.md)")
    p.add_argument("--autoscale-profile", default=None, metavar="FILE",
                   help="plan on this profile (pdserve plan --measure-profile; default: the "
                        "analytic model on this machine's measured CPU peaks)")
    p.add_argument("--autoscale-interval-s", type=float, default=None,
                   help="seconds between autoscale decisions (default 5)")
    for pool in ("prefill", "decode"):
        p.add_argument(f"--min-{pool}", type=int, default=None,
                       help=f"--autoscale: fewest {pool} workers (default 1)")
        p.add_argument(f"--max-{pool}", type=int, default=None,
                       help=f"--autoscale: most {pool} workers (default 4)")
    p.set_defaults(func=cmd_serve)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pdserve.client.bench_cli import add_arguments

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.client.bench_cli import run

    return run(args)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from pdserve.sim.cli import add_arguments

    p = sub.add_parser("simulate", help="a deployment under a benchmark's load, on a virtual "
                                        "clock (the router's and schedulers' own decisions)")
    _add_deployment_flags(p)
    add_arguments(p)
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.sim.cli import run

    return run(args, _cluster_config(args))


def _add_top(sub: argparse._SubParsersAction) -> None:
    from pdserve.cli.top import add_arguments

    p = sub.add_parser("top", help="live terminal view of a running cluster's metrics")
    add_arguments(p)
    p.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    from pdserve.cli.top import run

    return run(args)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from pdserve.planner.cli import add_arguments

    p = sub.add_parser("plan", help="size the prefill/decode pools for a rate and TTFT/TPOT SLOs")
    add_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.simulate:
        from pdserve.sim.plan import run as simulate_plan

        return simulate_plan(args)
    from pdserve.planner.cli import run

    return run(args)


def _add_admin(sub: argparse._SubParsersAction) -> None:
    from pdserve.cli import admin as admin_cli

    p = sub.add_parser("scale", help="set a running server's pool sizes (adds / drains workers)")
    admin_cli.add_scale_arguments(p)
    p.set_defaults(func=cmd_scale)
    p = sub.add_parser("workers", help="list a running server's workers")
    admin_cli.add_workers_arguments(p)
    p.set_defaults(func=cmd_workers)
    p = sub.add_parser("down", help="stop the workers of a deployment (serve --deployment)")
    p.add_argument("--address", required=True, help="the Ray cluster: auto | ray://host:port")
    p.add_argument("--deployment", required=True, metavar="NAME")
    p.set_defaults(func=cmd_down)


def cmd_scale(args: argparse.Namespace) -> int:
    from pdserve.cli.admin import run_scale

    return run_scale(args)


def cmd_workers(args: argparse.Namespace) -> int:
    from pdserve.cli.admin import run_workers

    return run_workers(args)


def cmd_down(args: argparse.Namespace) -> int:
    from pdserve.cluster.cluster import stop_deployment

    stopped = stop_deployment(args.address, args.deployment)
    print(f"stopped {len(stopped)} worker(s) of deployment {args.deployment!r}"
          + (f": {', '.join(stopped)}" if stopped else ""))
    return 0


def _cluster_config(args: argparse.Namespace) -> ClusterConfig:
    config = _load_cluster_config(args, _format_overrides(args, ("prefill", "decode")))
    if config.colocated is None:
        return config
    # The format flags reach a colocated pool only when there is one (setting its
    # keys would otherwise create it).
    return _load_cluster_config(args, _format_overrides(args, ("prefill", "decode", "colocated")))


def _load_cluster_config(args: argparse.Namespace, formats: dict[str, Any]) -> ClusterConfig:
    from pdserve.cluster.config import ClusterConfig

    return ClusterConfig.load(getattr(args, "config", None), {
        "model": args.model,
        "prefill.workers": getattr(args, "prefill_workers", None),
        "decode.workers": getattr(args, "decode_workers", None),
        "colocated.workers": getattr(args, "colocated_workers", None),
        "transfer": args.transfer,
        "grpc_port": getattr(args, "grpc_port", None),
        "http_port": getattr(args, "http_port", None),
        "host": getattr(args, "host", None),
        "address": getattr(args, "address", None),
        "deployment": getattr(args, "deployment", None),
        "router.policy": getattr(args, "policy", None),
        "router.local_prefill_max_tokens": getattr(args, "local_prefill_max_tokens", None),
        "router.placement": getattr(args, "placement", None),
        "api_key": getattr(args, "api_key", None),
        "api_key_file": getattr(args, "api_key_file", None),
        "protect_probes": getattr(args, "protect_probes", None),
        "file_sd_path": getattr(args, "file_sd", None),
        "ttft_slo_ms": getattr(args, "ttft_slo_ms", None),
        "otlp_traces_endpoint": getattr(args, "otlp_traces_endpoint", None),
        "trace_sample_ratio": getattr(args, "trace_sample_ratio", None),
        "shutdown_timeout_s": getattr(args, "shutdown_timeout_s", None),
        "tpot_slo_ms": getattr(args, "tpot_slo_ms", None),
        "autoscale": getattr(args, "autoscale", None),
        "autoscale_profile": getattr(args, "autoscale_profile", None),
        "autoscale_interval_s": getattr(args, "autoscale_interval_s", None),
        **{f"autoscale_{b}_{pool}": getattr(args, f"{b}_{pool}", None)
           for b in ("min", "max") for pool in ("prefill", "decode")},
        **formats,
    })


def _format_overrides(args: argparse.Namespace, pools: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool in pools:
        quant = getattr(args, f"{pool}_quantization", None) or getattr(args, "quantization", None)
        out[f"{pool}.engine.quantization"] = quant
        out[f"{pool}.engine.quantization_group_size"] = getattr(
            args, "quantization_group_size", None)
        out[f"{pool}.engine.dtype"] = getattr(args, "dtype", None)
        out[f"{pool}.engine.kv_cache_dtype"] = getattr(args, "kv_cache_dtype", None)
        out[f"{pool}.tensor_parallel_size"] = getattr(args, f"{pool}_tensor_parallel_size", None)
        spec = getattr(args, "speculative_config", None)
        # A prefill worker samples one token per request: of speculation it takes only
        # a draft model, whose prompt KV it makes for the decode worker.
        if pool != "prefill" or (spec or {}).get("method") == "draft_model":
            out[f"{pool}.engine.speculative_config"] = spec
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.cli.serve import serve

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level == "debug":  # pdserve's own, not every library's
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger("pdserve").setLevel(logging.DEBUG)
    asyncio.run(serve(_cluster_config(args)))
    # Everything the server started is stopped by now (workers killed, Ray shut
    # down, the targets file removed). The interpreter's own finalization is
    # skipped: after a stop while the workers were loading, Ray's extension left
    # the garbage collector's lists corrupt and the exit aborted (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _add_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="prepare the default model, make a tiny test model")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    prep = msub.add_parser("prepare", help="convert the default model's GGUF into the engine format")
    prep.add_argument("--cache-dir", default=None, help="where to write it")
    prep.add_argument("--force", action="store_true", help="convert again even if prepared")
    prep.set_defaults(func=cmd_prepare)
    tiny = msub.add_parser("make-tiny", help="write a small random-weight Llama-family checkpoint")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--preset", default="llama-gqa")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model.gguf_convert import resolve_model
    from pdserve.engine.results import Completion
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.worker.tensor_parallel import create_engine

    params = SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_dir(model_dir)
    prompt_ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}])
                  if args.chat else tok.encode(args.prompt))
    t0 = time.perf_counter()
    if args.disaggregated:
        import asyncio

        from pdserve.cli.serve import run_disaggregated

        cluster = _cluster_config(args)
        tokens, text, final = asyncio.run(run_disaggregated(cluster, prompt_ids, params))
        out = Completion(tokens, text, final.finish_reason, len(prompt_ids),
                         final.usage.cached_tokens)
    else:
        engine = create_engine(model_dir, EngineConfig(
            dtype=args.dtype or "auto", num_threads=args.threads,
            quantization=args.quantization or "none",
            quantization_group_size=args.quantization_group_size or 32,
            tensor_parallel_size=args.tensor_parallel_size or 1,
            kv_cache_dtype=args.kv_cache_dtype or "auto",
            speculative_config=args.speculative_config), tokenizer=tok)
        try:
            (out,) = engine.generate([prompt_ids], params)
        finally:
            engine.close()
    elapsed = time.perf_counter() - t0
    if args.json:
        obj: dict[str, Any] = {
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.token_ids),
            "model": model_dir.name,
            "elapsed_s": round(elapsed, 4),
        }
        if args.logprobs is not None:
            obj["logprobs"] = [
                {"token_id": lp.token_id, "logprob": lp.logprob,
                 "top": [[t, v] for t, v in lp.top]} for lp in out.logprobs
            ]
        print(json.dumps(obj, ensure_ascii=False))
    else:
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
              f"{elapsed:.2f}s]", file=sys.stderr)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from pdserve.engine.model.gguf_convert import prepare_default_model

    path = prepare_default_model(cache_dir=args.cache_dir, force=args.force)
    print(path)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from pdserve.engine.model.tiny import make_tiny

    print(make_tiny(args.out, preset=args.preset, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_simulate(sub)
    _add_top(sub)
    _add_plan(sub)
    _add_admin(sub)
    _add_model(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:  # the user's input: one clear line
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
