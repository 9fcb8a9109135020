"""``pdserve plan``'s command line (and ``python -m pdserve.planner.cli
--validate``): the flags, the step-time model they choose (analytic or a measured
profile), the plan printed; ``--measure-profile`` and ``--validate`` run the engine
(``profile.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pdserve.engine import defaults
from pdserve.planner.sizing import SLO, Bounds, Planner
from pdserve.planner.step_times import (
    DEFAULT_MBU,
    DEFAULT_MFU,
    HARDWARE,
    MODEL_PRESETS,
    AnalyticModel,
    Profile,
    StepTimes,
    resolve_hardware,
    resolve_model_config,
)


# --------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or model directory")
    p.add_argument("--hardware", default=None,
                   help=f"{', '.join(HARDWARE)} or cpu (peaks measured unless given)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per worker (peaks x tp)")
    p.add_argument("--rate", type=float, default=None, help="arrival rate, requests/s")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT target, ms")
    p.add_argument("--tpot-slo", type=float, default=None, help="TPOT target, ms")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 (default) | float16 | float32; --measure-profile: auto")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"model FLOPs utilisation reached (default {DEFAULT_MFU})")
    p.add_argument("--mbu", type=float, default=DEFAULT_MBU,
                   help=f"memory bandwidth utilisation reached (default {DEFAULT_MBU})")
    p.add_argument("--peak-flops", type=float, default=None, help="device FLOP/s (overrides)")
    p.add_argument("--peak-bandwidth", type=float, default=None, help="device bytes/s (overrides)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker (cpu, profile)")
    p.add_argument("--max-batch", type=int, default=defaults.MAX_NUM_SEQS,
                   help="decode engine's max_num_seqs (default %(default)s)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache of one decode worker, GB (default: GPU memory left after "
                        "the weights at 90%%; CPU: the engine's 256 MiB)")
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE)
    for pool in ("prefill", "decode"):
        p.add_argument(f"--min-{pool}", type=int, default=1)
        p.add_argument(f"--max-{pool}", type=int, default=64)
    p.add_argument("--profile", default=None,
                   help="plan on a measured profile (JSON) instead of the analytic model")
    p.add_argument("--measure-profile", default=None, metavar="FILE",
                   help="measure this CPU's engine step times for --model DIR, write FILE")
    sim = p.add_argument_group("--simulate: sizes chosen by simulated goodput (pdserve simulate)")
    sim.add_argument("--simulate", action="store_true",
                     help="simulate the closed-form sizes and their neighbours, and colocated "
                          "deployments of as many GPUs; choose the fewest GPUs meeting both "
                          "SLOs for 90%% of requests")
    sim.add_argument("--tp-options", default=None, metavar="T,T,...",
                     help="tensor-parallel degrees to try (default: --tp)")
    sim.add_argument("--max-gpus", type=int, default=None, help="largest deployment considered")
    sim.add_argument("--duration", type=float, default=120.0,
                     help="seconds of traffic simulated per candidate (default 120)")
    sim.add_argument("--link", default=None,
                     help="KV link: nvlink, infiniband (default on GPUs), roce, tcp, nixl-cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def require(args: argparse.Namespace, names: Sequence[str]) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise ValueError(f"pdserve plan needs {', '.join(missing)}")


def times_from_args(args: argparse.Namespace) -> StepTimes:
    if args.profile:
        return Profile.load(args.profile)
    require(args, ("model", "hardware"))
    model = resolve_model_config(args.model)
    hw = resolve_hardware(args.hardware, peak_flops=args.peak_flops,
                          peak_bandwidth=args.peak_bandwidth, threads=args.threads)
    return AnalyticModel(model, hw, tp=args.tp, dtype=args.dtype or "bfloat16",
                         quantization=args.quantization, mfu=args.mfu, mbu=args.mbu)


def run(args: argparse.Namespace) -> int:
    """``pdserve plan``: 0 when the recommendation meets both SLOs, 1 when no size
    within the bounds does (the plan says which pool and SLO)."""
    if args.measure_profile:
        if not args.model:
            raise ValueError("--measure-profile needs --model DIR (a local model directory)")
        from pdserve.engine.model.gguf_convert import resolve_model
        from pdserve.planner.profile import measure_profile

        prof = measure_profile(resolve_model(args.model), dtype=args.dtype or "auto",
                               quantization=args.quantization, threads=args.threads,
                               log=lambda s: print(s, file=sys.stderr, flush=True))
        prof.save(args.measure_profile)
        if args.json:
            print(json.dumps(prof.to_dict()))
        else:
            a, b, c = prof.prefill_coef
            d, e, f = prof.decode_coef
            print(f"profile of {prof.describe()} in {prof.measured_s:.1f} s ({prof.clock} clock) -> "
                  f"{args.measure_profile}\n"
                  f"  prefill_ms(N) = {a:.4g} + {b:.4g}·N + {c:.4g}·N²  "
                  f"(worst fit error {prof.fit_error_pct['prefill']:.1f}%)\n"
                  f"  decode_ms(B, ctx) = {d:.4g} + {e:.4g}·B + {f:.4g}·B·ctx  "
                  f"(worst fit error {prof.fit_error_pct['decode']:.1f}%)")
        return 0
    require(args, ("rate", "prompt_len", "output_len", "ttft_slo", "tpot_slo"))
    slo = SLO(args.ttft_slo, args.tpot_slo)
    bounds = Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode)
    if not args.rate > 0:  # before anything is measured
        raise ValueError(f"--rate must be > 0 req/s, got {args.rate}")
    times = times_from_args(args)
    kv_tokens = None
    if args.kv_cache_gb is not None:
        if not args.kv_cache_gb > 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
        kv_tokens = int(args.kv_cache_gb * 1e9 // times.kv_bytes_per_token)
    planner = Planner(times, slo, bounds, max_batch=args.max_batch, kv_tokens=kv_tokens,
                      block_size=args.block_size)
    plan = planner.plan(args.rate, args.prompt_len, args.output_len)
    if args.json:
        print(json.dumps({**plan.to_dict(), "source": times.source,
                          "kv_tokens_per_decode_worker": planner.kv_tokens}))
    else:
        print(plan.describe())
    return 0 if plan.feasible else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.planner.cli",
                                 description="pdserve plan, plus --validate")
    add_arguments(ap)
    ap.add_argument("--validate", action="store_true",
                    help="profile this CPU (default model unless --model), then compare the "
                         "profile's TTFT/TPOT with measured engine runs")
    args = ap.parse_args(argv)
    try:
        if args.validate:
            from pdserve.planner.profile import validate

            validate(args.model, threads=args.threads, profile_out=args.profile)
            return 0
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
