"""Issue 55's drain goal, served: a decode worker running ``--streams`` long
generations leaves (``POST /admin/scale {"remove": [...]}``) and its requests move to
the other decode worker with their KV (router/migration.py).

The default model, ``pdserve serve``'s transfer (nixl). 1P+1D first, so every stream
lands on decode-0; a second decode worker joins; then decode-0 is named to leave.
Half the streams greedy, half seeded (temperature 0.8). Then the same requests again
on the server as it is now (1P+1D, nothing moving): the reference. Reported:

* how long decode-0 took to leave (the remove call to the scale status reached);
* failed requests, retries (each one a prefill again), moves by outcome, the move
  pause (router histogram: last token read from A to first from B);
* streams whose text differs from the reference;
* client side, per moved stream: the longest gap between two chunks around the move
  against the median gap before it (the goal: at most 3x).

Second part (``skew``): rebalancing under a skewed load (``skew_part``).

Run: ``python -m benchmarks.moves [--part drain,skew] [--streams 32] [--max-tokens
1600] [--rounds 2] [--out f.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.harness import Served, metric
from pdserve.client.openai_stream import OpenAIStreamClient, RequestOutput, request_body

# (half a CPU each: two decode workers and the prefill worker fit this VM's two)
CONFIG = {"decode": {"workers": 1, "num_cpus": 0.5, "engine": {"num_blocks": 4096}},
          "router": {"queue_timeout_s": 600}}
POLL_S = 0.05
WORDS = ("river", "stone", "lantern", "orbit", "meadow", "copper", "signal", "harbor")


def prompt(i: int) -> str:
    """A different ~60-token prompt per stream."""
    words = itertools.islice(itertools.cycle(WORDS[i % 8:] + WORDS[:i % 8]), 40)
    return f"Story {i}: " + " ".join(words) + ". Continue the story in detail:"


def admin(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(f"{url}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


async def until(what: str, ok: Any, timeout_s: float) -> float:
    """Poll ``ok()`` (a blocking call, on a thread) until true; when it became so."""
    deadline = time.perf_counter() + timeout_s
    while not await asyncio.to_thread(ok):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:g}s")
        await asyncio.sleep(POLL_S)
    return time.perf_counter()


def scaled(url: str) -> bool:
    """Whether the scale targets are reached (a scaling error raises)."""
    status = admin(url, "GET", "/admin/scale")
    if status["error"] is not None:
        raise RuntimeError(f"scaling failed: {status['error']}")
    return bool(status["reached"])


def requests_on(url: str, worker: str) -> int:
    for w in admin(url, "GET", "/admin/workers")["workers"]:
        if w["id"] == worker:
            return int(w["requests"])
    return 0


async def run_streams(url: str, model: str, n: int, max_tokens: int,
                      during: Any = None) -> tuple[list[RequestOutput], dict[str, float]]:
    bodies = [request_body("/v1/completions", model, prompt(i), max_tokens, True,
                           {"temperature": 0.0} if i % 2 == 0
                           else {"temperature": 0.8, "seed": 1000 + i})
              for i in range(n)]
    async with OpenAIStreamClient(url) as client:
        tasks = [asyncio.create_task(client.stream("/v1/completions", b)) for b in bodies]
        marks = await during(tasks) if during is not None else {}
        outs = await asyncio.gather(*tasks)
    return outs, marks


def chunk_times(out: RequestOutput) -> list[float]:
    first = out.start_time + out.ttft
    return [first, *(first + t for t in itertools.accumulate(out.itl))]


def gaps(outs: list[RequestOutput], start: float, end: float) -> dict[str, Any]:
    """The median gap before ``start`` and the longest gap that overlaps the move
    window [start, end], over every stream; their ratio."""
    before: list[float] = []
    per_stream: list[tuple[float, float]] = []  # each stream's longest gap in the window
    for out in outs:
        times = chunk_times(out)
        worst = (0.0, 0.0)
        for a, b in itertools.pairwise(times):
            if b <= start:
                before.append(b - a)
            elif a <= end and b - a > worst[0]:
                worst = (b - a, a - start)
        per_stream.append(worst)
    median = statistics.median(before) if before else float("nan")
    longest = sorted(g for g, _ in per_stream)
    return {"median_gap_before_s": median, "longest_gap_in_move_s": longest[-1],
            "ratio": longest[-1] / median if median else float("nan"),
            "streams_longest_gap_p50_s": longest[len(longest) // 2],
            # (gap, when it began after the drain call), the five longest
            "worst_five": sorted(per_stream, reverse=True)[:5]}


def drain_part(streams: int, max_tokens: int) -> dict[str, Any]:
    """The drain goal (module doc)."""
    with Served(CONFIG) as server:
        url = server.url
        model = admin(url, "GET", "/v1/models")["data"][0]["id"]
        started = time.perf_counter()

        async def drain(tasks: list[asyncio.Task[RequestOutput]]) -> dict[str, float]:
            await until("every stream on decode-0",
                        lambda: requests_on(url, "decode-0") >= streams, 600)
            admin(url, "POST", "/admin/scale", {"decode": 2})
            await until("decode-1 serving", lambda: scaled(url), 600)
            t0 = time.perf_counter()
            admin(url, "POST", "/admin/scale", {"remove": ["decode-0"]})
            t1 = await until("decode-0 gone", lambda: scaled(url), 600)
            assert not any(t.done() for t in tasks), "a stream ended before the drain"
            return {"drain_start": t0, "drain_end": t1, "wait_s": t0 - started}

        moved, marks = asyncio.run(run_streams(url, model, streams, max_tokens, drain))
        figures: dict[str, Any] = {
            "streams": streams, "max_tokens": max_tokens,
            "worker_gone_s": marks["drain_end"] - marks["drain_start"],
            "failed": sum(not o.success for o in moved),
            "errors": sorted({o.error for o in moved if o.error})[:5],
            **move_metrics(server.scrape()),
            **gaps(moved, marks["drain_start"], marks["drain_end"]),
        }
        reference, _ = asyncio.run(run_streams(url, model, streams, max_tokens))
        figures["differ"] = [i for i, (a, b) in enumerate(zip(moved, reference, strict=True))
                             if a.generated_text != b.generated_text]
        figures["output_tokens"] = [min(o.output_tokens for o in moved),
                                    max(o.output_tokens for o in moved)]
        figures["chunks_left_at_drain"] = min(
            sum(t > marks["drain_start"] for t in chunk_times(o)) for o in moved)
    return figures


def move_metrics(text: str) -> dict[str, Any]:
    """The router's move counters and mean pause, from its /metrics."""
    return {
        "retries": metric(text, "pdserve_request_retries_total"),
        "moves": {outcome: metric(text, "pdserve_request_moves_total", outcome=outcome)
                  for outcome in ("moved", "abandoned", "failed")},
        "move_kv_bytes": metric(text, "pdserve_request_move_kv_bytes_total"),
        "pause_mean_s": (metric(text, "pdserve_request_move_pause_seconds_sum")
                         / max(1.0, metric(text, "pdserve_request_move_pause_seconds_count"))),
    }


def skew_part(rounds: int) -> dict[str, Any]:
    """Rebalancing under a skewed load: 1P+2D with ``prefix_affinity`` and one prefix
    shared by every prompt, so the decode worker holding it gets the requests (while it
    has room); ``pdserve bench``'s TPOT and throughput with ``router.rebalance`` off and
    on, in one order then the other."""
    flags = ("--dataset", "random", "--random-input-len", "320", "--random-prefix-len",
             "256", "--random-output-len", "384", "--num-prompts", "48", "--request-rate",
             "2", "--ignore-eos", "--seed", "5", "--percentile-metrics", "ttft,tpot,itl",
             "--metric-percentiles", "50,90,99")
    out: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            config = {"decode": {"workers": 2, "num_cpus": 0.5,  # (room: stickiness holds)
                                 "engine": {"num_blocks": 2048}},
                      "router": {"policy": "prefix_affinity", "queue_timeout_s": 600,
                                 "rebalance": mode == "on", "rebalance_min_excess": 2}}
            with Served(config) as server:
                res = server.bench(*flags)
                out[mode].append({k: res[k] for k in (
                    "completed", "output_throughput", "mean_tpot_ms", "p99_tpot_ms",
                    "p99_itl_ms", "p99_ttft_ms")} | move_metrics(server.scrape()))
    ratios = [on["p99_tpot_ms"] / off["p99_tpot_ms"]
              for on, off in zip(out["on"], out["off"], strict=True)]
    return {**out, "p99_tpot_on_over_off": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="drain,skew", help="drain, skew or both")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=1600)
    ap.add_argument("--rounds", type=int, default=2, help="of the skewed load")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    parts = args.part.split(",")
    figures: dict[str, Any] = {}
    if "drain" in parts:
        figures["drain"] = drain_part(args.streams, args.max_tokens)
    if "skew" in parts:
        figures["skew"] = skew_part(args.rounds)
    print(json.dumps(figures, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
