"""``make bench``: the simulator against served runs on this machine (issue 51).

Each point -- a deployment, a workload, a request rate -- is served (``pdserve
serve`` + ``pdserve bench --scrape-metrics``) in ``--rounds`` rounds (the second in
reverse order: this VM drifts) and simulated once (``pdserve simulate``, the same
config and bench flags, on profiles measured here first by ``pdserve plan
--measure-profile``: one and two threads). Reported per point and metric: served p50
and p90 (each round), simulated, the error against the served rounds' mean, and the
served runs' own spread -- the tolerance where it exceeds the goal's 10%; a server
stage (a histogram: its quantiles interpolate inside buckets 5-50 ms wide) also
passes within 5 ms.

Calibration, per deployment, on two points no other is: one stream (requests one at
a time) of 256- and 1024-token prompts, every prompt on a prefill worker where there
are pairs (``placement: static``: the loaded points compute most prompts there). Served TPOT over the simulated one is the
served decode steps' slowdown on cores they share with the router and the client;
TTFT at the two lengths gives the prompt tokens' slowdown and the router's own cost
per request (served TTFT = request + slowdown x simulated; ``--step-time-scale
prefill=,decode=``, ``--overheads-ms request=``); on 1p1d, what the KV transfer takes
beyond the link model is the link's latency.

Deployments (each worker on cores of its own: no core sharing): ``colocated`` (one
worker, two threads) and ``1p1d`` (one prefill, one decode worker, a thread each).
Workloads: ``chat`` (random 256-token prompts, 64 out, lengths +-50%), ``long``
(1024-token prompts, 16 out) and ``trace`` (Mooncake's conversation trace, scaled:
``WORKLOADS``; its loads are the trace clock's slow-down, not rates).

Run: ``python -m benchmarks.simulate [--deployments colocated,1p1d]
[--workloads chat,long] [--rounds 2] [--out result.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness import CLI, Served

ROUTER = {"queue_timeout_s": 600}
MOONCAKE = Path(__file__).resolve().parents[2] / "shared/data/mooncake/conversation_trace.jsonl"
DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "colocated": {"prefill": {"workers": 0}, "decode": {"workers": 0},
                  "colocated": {"workers": 1, "num_cpus": 2, "shared_cpus": 0},
                  "router": ROUTER},
    "1p1d": {"prefill": {"workers": 1, "num_cpus": 1, "shared_cpus": 0},
             "decode": {"workers": 1, "num_cpus": 1, "shared_cpus": 0}, "router": ROUTER},
}
# workload -> (bench flags, request rates, goodput SLOs)
WORKLOADS: dict[str, tuple[list[str], tuple[float, ...], list[str]]] = {
    "chat": (["--random-input-len", "256", "--random-output-len", "64",
              "--random-range-ratio", "0.5", "--num-prompts", "40"], (1.0, 2.0, 2.8),
             ["ttft:1000", "tpot:100"]),
    "long": (["--random-input-len", "1024", "--random-output-len", "16",
              "--num-prompts", "24"], (0.4, 0.8, 1.2), ["ttft:3000", "tpot:100"]),
    # Mooncake's conversation trace, its first 30 requests (bursts of up to 16 at once),
    # lengths x 0.05 (~600-token prompts, ~20 out; clipped to the simulated 2,048 served
    # too), its clock slowed by each "rate": the trace's time scale
    "trace": (["--dataset", "trace", "--dataset-path", str(MOONCAKE), "--trace-length-scale",
               "0.05", "--num-prompts", "30", "--max-model-len", "2048"], (8.0, 4.0, 2.7), ["ttft:3000", "tpot:100"]),
}
# (workload, rate) of the two calibration points: one stream each, see the module doc
CALIBRATION = (("one stream, 256", 0.0), ("one stream, 1024", 0.0))
CALIBRATION_FLAGS = {
    "one stream, 256": ["--random-input-len", "256", "--random-output-len", "64",
                        "--num-prompts", "8"],
    "one stream, 1024": ["--random-input-len", "1024", "--random-output-len", "16",
                         "--num-prompts", "6"],
}
STAGE_SLACK_MS = 5.0
CLIENT = ("ttft", "tpot", "e2el")
STAGES = {"prefill_queue": "pdserve_prefill_queue_seconds",
          "prefill": "pdserve_prefill_seconds",
          "kv_transfer": "pdserve_kv_transfer_seconds"}


def flags(workload: str, rate: float) -> list[str]:
    if workload in CALIBRATION_FLAGS:
        return [*CALIBRATION_FLAGS[workload], "--max-concurrency", "1", "--request-rate", "inf",
                "--ignore-eos", "--metric-percentiles", "50,90", "--seed", "2"]
    extra, _, slo = WORKLOADS[workload]
    pace = ["--trace-time-scale" if "trace" in extra else "--request-rate", str(rate)]
    return [*extra, *pace, "--ignore-eos", "--goodput", *slo,
            "--metric-percentiles", "50,90", "--seed", "1"]


def load(workload: str, rate: float) -> str:
    """A point's load as its flags set it."""
    return f"time x {rate:g}" if "trace" in WORKLOADS.get(workload, ([], 0, 0))[0] else (
        f"{rate:g} req/s")


def figures(result: dict[str, Any]) -> dict[str, float]:
    """metric -> value: client p50/p90 of TTFT, TPOT, E2E; server stage p50/p90;
    goodput."""
    out = {}
    for m in CLIENT:
        for p in ("p50", "p90"):
            out[f"{m} {p}"] = result[f"{p}_{m}_ms"]
    for name, hist in STAGES.items():
        row = result.get("server_metrics", {}).get(hist)
        for p in ("p50", "p90"):
            if row and row.get(f"{p}_ms") is not None:
                out[f"{name} {p}"] = row[f"{p}_ms"]
    if result.get("request_goodput") is not None:
        out["goodput req/s"] = result["request_goodput"]
    return out


def measure_profiles(model: str, workdir: Path) -> list[Path]:
    paths = []
    for threads in (1, 2):
        path = workdir / f"profile-t{threads}.json"
        subprocess.run([*CLI, "plan", "--measure-profile", str(path), "--model", model,
                        "--threads", str(threads)], check=True, capture_output=True)
        paths.append(path)
    return paths


def simulated(config: dict[str, Any], workload: str, rate: float, profiles: list[Path],
              workdir: Path, extra: list[str]) -> dict[str, Any]:
    cfg = workdir / "sim.yaml"
    cfg.write_text(yaml.safe_dump(config))
    out = workdir / "sim.json"
    profile_flags = [x for p in profiles for x in ("--profile", str(p))]
    subprocess.run([*CLI, "simulate", "--config", str(cfg), *profile_flags,
                    "--max-model-len", "2048", *flags(workload, rate), *extra,
                    "--result-filename", str(out)], check=True, capture_output=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def calibrate(config: dict[str, Any], rounds: list[dict[tuple[str, float], dict[str, Any]]],
              profiles: list[Path], workdir: Path, prompts: bool = True) -> list[str]:
    """The simulator's flags for this deployment, from its served one-stream runs:
    decoding rows' scale from TPOT; prompt tokens' scale and the router's cost per
    request from TTFT at two prompt lengths (TTFT = request + scale x simulated); with
    ``prompts`` off, prompt tokens as the profile says and the router's cost from the
    256-token point alone."""
    def served(point: tuple[str, float], key: str) -> float:
        return sum(figures(r[point])[key] for r in rounds) / len(rounds)

    zero = ["--overheads-ms", "request=0,call=0,token=0,step=0"]
    short, long = CALIBRATION
    base = {p: figures(simulated(config, *p, profiles, workdir, zero)) for p in CALIBRATION}
    decode = served(short, "tpot p50") / base[short]["tpot p50"]
    prefill = max(0.5, (served(long, "ttft p50") - served(short, "ttft p50"))
                  / (base[long]["ttft p50"] - base[short]["ttft p50"])) if prompts else 1.0
    request_ms = max(0.0, served(short, "ttft p50") - prefill * base[short]["ttft p50"])
    out = ["--step-time-scale", f"prefill={prefill:.4f},decode={decode:.4f}",
           "--overheads-ms", f"request={request_ms:.2f},call=0,token=0,step=0"]
    if all("kv_transfer p50" in figures(r[short]) for r in rounds) \
            and "kv_transfer p50" in base[short]:
        latency_ms = 2.3 + max(0.0, served(short, "kv_transfer p50")
                               - base[short]["kv_transfer p50"])
        out += ["--link-latency-ms", f"{latency_ms:.2f}"]
    return out


def calibration_config(deployment: str) -> dict[str, Any]:
    """Calibration runs compute every prompt where the loaded points mostly do: on a
    prefill worker where there are pairs (``placement: static``; at one stream the
    placement rule would compute them on the idle decode worker)."""
    config = DEPLOYMENTS[deployment]
    return {**config, "router": {**config["router"], "placement": "static"}}


def served_round(deployment: str, points: list[tuple[str, float]], keep: Path,
                 index: int) -> dict[tuple[str, float], dict[str, Any]]:
    """One round of served runs (the calibration points on their own deployment);
    each result also kept in ``keep`` (``--reuse``)."""
    results = {}
    calibration = [p for p in points if p in CALIBRATION]
    if calibration:
        with Served(calibration_config(deployment)) as server:
            for workload, rate in calibration:
                r = server.bench(*flags(workload, rate), "--scrape-metrics")
                results[(workload, rate)] = r
                (keep / _name(deployment, index, workload, rate)).write_text(json.dumps(r))
        points = [p for p in points if p not in CALIBRATION]
    with Served(DEPLOYMENTS[deployment]) as server:
        for workload, rate in points:
            r = server.bench(*flags(workload, rate), "--scrape-metrics")
            results[(workload, rate)] = r
            (keep / _name(deployment, index, workload, rate)).write_text(json.dumps(r))
            print(f"  served {deployment} {workload} {load(workload, rate)}: "
                  f"{r['completed']} completed", flush=True)
    return results


def _name(deployment: str, index: int, workload: str, rate: float) -> str:
    return f"served-{deployment}-{index}-{workload.replace(' ', '_').replace(',', '')}-{rate}.json"


def reused_round(deployment: str, points: list[tuple[str, float]], keep: Path,
                 index: int) -> dict[tuple[str, float], dict[str, Any]]:
    return {(w, r): json.loads((keep / _name(deployment, index, w, r)).read_text())
            for w, r in points}


def compare(served: list[dict[str, float]], sim: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for metric, value in sim.items():
        got = [s[metric] for s in served if metric in s]
        if not got:
            continue
        mean = sum(got) / len(got)
        spread = (max(got) - min(got)) / mean * 100 if mean and len(got) > 1 else 0.0
        error = (value - mean) / mean * 100 if mean else math.nan
        stage = metric.split()[0] in STAGES
        rows.append({"metric": metric, "served": got, "simulated": value,
                     "error_pct": error, "spread_pct": spread,
                     "within": abs(error) <= max(10.0, spread)
                     or (stage and abs(value - mean) <= STAGE_SLACK_MS)})
    return rows


def print_point(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'metric':<20}{'served':>22}{'simulated':>11}{'error %':>9}{'spread %':>10}")
    for row in rows:
        served = " / ".join(f"{v:.1f}" for v in row["served"])
        print(f"{row['metric']:<20}{served:>22}{row['simulated']:>11.1f}"
              f"{row['error_pct']:>9.1f}{row['spread_pct']:>10.1f}"
              f"{'' if row['within'] else '  *'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", default="colocated,1p1d")
    ap.add_argument("--workloads", default="chat,long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--out", default=None)
    ap.add_argument("--calibrate", choices=("both", "decode"), default="both",
                    help="scales calibrated: prompt tokens' and decoding rows' (default), "
                         "or decoding rows' alone (prompt tokens as the profile says)")
    ap.add_argument("--reuse", default=None, metavar="DIR",
                    help="a previous run's directory: its profiles and served results, "
                         "simulated again (nothing served)")
    args = ap.parse_args()
    workdir = Path(args.reuse or tempfile.mkdtemp(prefix="pdserve-simcheck-"))
    print(f"profiles and served results: {workdir}", flush=True)
    profiles = ([workdir / f"profile-t{t}.json" for t in (1, 2)] if args.reuse
                else measure_profiles(args.model, workdir))
    report: dict[str, Any] = {"profiles": [json.loads(p.read_text()) for p in profiles],
                              "points": []}
    for deployment in args.deployments.split(","):
        config = DEPLOYMENTS[deployment]
        points = [*CALIBRATION, *((w, r) for w in args.workloads.split(",")
                                  for r in WORKLOADS[w][1])]
        rounds = []
        for i in range(args.rounds):
            order = points if i % 2 == 0 else points[::-1]
            run_round = reused_round if args.reuse else served_round
            rounds.append(run_round(deployment, order, workdir, i))
        sim_flags = calibrate(calibration_config(deployment), rounds, profiles, workdir,
                              args.calibrate == "both")
        report["calibration"] = {**report.get("calibration", {}), deployment: sim_flags}
        print(f"\n{deployment}: calibrated on one stream: {' '.join(sim_flags)}")
        for workload, rate in points:
            sim = simulated(calibration_config(deployment) if (workload, rate) in CALIBRATION
                            else config, workload, rate, profiles, workdir, sim_flags)
            rows = compare([figures(r[(workload, rate)]) for r in rounds], figures(sim))
            served_placed = [r[(workload, rate)].get("server_placements") for r in rounds]
            report["points"].append({"deployment": deployment, "workload": workload,
                                     "rate": rate, "rows": rows,
                                     "placement": sim["server_placements"],
                                     "served_placement": served_placed})
            print_point(f"{deployment}, {workload}, {load(workload, rate)} (prompts computed: "
                        f"simulated {sim['server_placements']}, served "
                        f"{' / '.join(str(p) for p in served_placed)})", rows)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
