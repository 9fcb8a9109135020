"""``make soak``: a long steady load on a real deployment (not in CI; 20 minutes by
default), reporting what drifts: RSS and open fds of every process the server started,
KV blocks in use when idle between rounds, and latency (p50 TTFT / TPOT per round).

The load is rounds of ``pdserve bench`` at a fixed request rate (random prompts);
between rounds the deployment is idle for a moment and sampled. A leak shows as RSS or
fds that grow round after round, blocks in use at idle, or latency that climbs.

Run: ``python -m benchmarks.soak [--minutes 20] [--rate 2] [--round-s 60]
[--model DIR] [--transfer nixl]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.harness import Served, metric, proc_usage


def sample(served: Served) -> dict[str, Any]:
    """RSS/fds per process and KV blocks in use per worker, now."""
    procs = {f"{name}[{pid}]": proc_usage(pid) for pid, name in served.processes().items()}
    blocks = {}
    for wid in served.workers:
        text = served.scrape(wid)
        blocks[wid] = int(metric(text, "pdserve_kv_blocks_capacity")
                          - metric(text, "pdserve_kv_blocks_free"))
    return {"procs": procs, "blocks": blocks}


def report(rounds: list[dict[str, Any]]) -> str:
    first, last = rounds[0], rounds[-1]
    lines = [f"soak: {len(rounds)} rounds, {sum(r['completed'] for r in rounds)} requests, "
             f"{sum(r['failed'] for r in rounds)} failed", "",
             f"{'process':34} {'RSS MiB first':>14} {'last':>8} {'drift':>8} "
             f"{'fds first':>10} {'last':>6}"]
    for proc, (rss0, fds0) in sorted(first["procs"].items()):
        rss1, fds1 = last["procs"].get(proc, (0.0, 0))
        lines.append(f"{proc:34} {rss0:14.0f} {rss1:8.0f} {rss1 - rss0:+8.0f} "
                     f"{fds0:10d} {fds1:6d}")
    lines += ["", f"{'round':>5} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'blocks in use at idle':>24}"]
    for i, r in enumerate(rounds):
        lines.append(f"{i:5d} {r['ttft']:12.1f} {r['tpot']:12.2f} {r['blocks']!s:>24}")
    drift = (last["ttft"] / first["ttft"] - 1, last["tpot"] / first["tpot"] - 1)
    lines.append(f"\nlatency drift last vs first round: TTFT {drift[0]:+.1%}, TPOT {drift[1]:+.1%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--round-s", type=float, default=60.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--transfer", default="nixl")
    args = ap.parse_args()
    config: dict[str, Any] = {"transfer": args.transfer, "router": {"queue_timeout_s": 120}}
    if args.model:
        config["model"] = args.model
    rounds: list[dict[str, Any]] = []
    with Served(config) as served:
        end = time.monotonic() + 60 * args.minutes
        while time.monotonic() < end or not rounds:
            result = served.bench(
                "--dataset", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--request-rate", str(args.rate),
                "--num-prompts", str(max(1, int(args.rate * args.round_s))),
                "--seed", str(len(rounds)), "--metric-percentiles", "50")
            time.sleep(2)  # let the last aborts and acknowledgements land: sample idle
            rounds.append({**sample(served), "completed": result["completed"],
                           "failed": result["failed"],
                           "ttft": result["median_ttft_ms"], "tpot": result["median_tpot_ms"]})
            print(f"round {len(rounds)}: {result['completed']} done, TTFT p50 "
                  f"{result['median_ttft_ms']:.0f} ms, TPOT p50 {result['median_tpot_ms']:.1f} ms, "
                  f"blocks at idle {rounds[-1]['blocks']}", flush=True)
    print(report(rounds))


if __name__ == "__main__":
    main()
