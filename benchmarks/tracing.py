"""``make bench`` for tracing's cost: single-stream TPOT of ``pdserve serve``'s
default (1P+1D) without tracing, with ``--otlp-traces-endpoint`` at
``trace_sample_ratio`` 0 (the exporter loaded, nothing sampled) and at 1.0 (every
request traced, its spans exported to a real OTLP/gRPC receiver in this process).

The three run one after another, the order reversed every round (this VM drifts
over minutes); each round starts each server anew. Reports median TPOT per mode per
round, each traced mode's ratio to the untraced one of the same round, and the spans
the receiver got (none at ratio 0; at 1.0 five per request whose prompt the decode
worker computed -- the router's llm_request, queue and attempt, prefill and decode --
and eight for one computed on the prefill worker: prefill_queue, kv_send and
kv_receive too).

A server started anew lands on this VM's cores differently each time (a few percent
of TPOT either way), more than tracing can cost, so the bench also times tracing's own
work per request in this process: a request's router spans and five worker spans,
made and exported, against the untraced TPOT x tokens of a request --
an upper bound of the share of a request's time tracing takes (none of it is per
token; the export runs on its own thread).

Run: ``python -m benchmarks.tracing [--rounds 4] [--requests 12]
[--max-tokens 128] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.harness import Served
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.observability.otlp_sink import OtlpReceiver
from pdserve.router.trace import RequestTrace
from pdserve.router.types import FinalChunk, Usage
from pdserve.tracing import Marks, Tracing, TracingConfig

MODES = ("off", "ratio 0", "ratio 1")
CLIENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def config(mode: str, endpoint: str) -> dict[str, Any]:
    if mode == "off":
        return {}
    return {"otlp_traces_endpoint": endpoint,
            "trace_sample_ratio": 0.0 if mode == "ratio 0" else 1.0}


def run(mode: str, sink: OtlpReceiver, requests: int, max_tokens: int) -> dict[str, float]:
    before = len(sink.spans())
    with Served(config(mode, sink.endpoint)) as server:
        r = server.bench("--dataset", "random", "--random-input-len", "128",
                         "--random-output-len", str(max_tokens), "--num-prompts",
                         str(requests), "--max-concurrency", "1", "--ignore-eos",
                         "--metric-percentiles", "50")
    # a server's last spans go out when it stops (its exporters' shutdown)
    return {"tpot_ms": float(r["median_tpot_ms"]), "spans": float(len(sink.spans()) - before),
            "requests": float(r["completed"])}


def tracing_work_s(sink: OtlpReceiver, ratio: float, n: int = 250) -> float:
    """Seconds of tracing's own work per request (router and worker spans, exported;
    ``n`` requests' spans fit the exporter's queue of 2,048: none is dropped)."""
    tracing = Tracing("bench", TracingConfig(sink.endpoint, sample_ratio=ratio))
    params = SamplingParams(max_tokens=128)
    final = FinalChunk("length", Usage(128, 128))
    t0 = time.perf_counter()
    for i in range(n):
        trace = RequestTrace(tracing, None if ratio < 1 else CLIENT, f"r{i}", "m", params, 128)
        carrier = trace.attempt(0)
        trace.admitted({"pdserve.worker": "decode-0", "pdserve.placement": "remote"})
        if carrier is not None:
            for name in ("prefill_queue", "prefill", "kv_send", "kv_receive", "decode"):
                marks = Marks(tracing, carrier, "w")
                marks.mark("end")
                marks.span(name, "start", "end", prompt_tokens=128)
        trace.finished(final)
    tracing.shutdown()  # its export is part of the work
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    sink = OtlpReceiver()
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for i in range(args.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            got = {mode: run(mode, sink, args.requests, args.max_tokens) for mode in order}
            rounds.append(got)
            off = got["off"]["tpot_ms"]
            print(f"round {i + 1} ({', '.join(order)}): " + "; ".join(
                f"{m} TPOT {got[m]['tpot_ms']:.2f} ms ({got[m]['tpot_ms'] / off:.3f}x), "
                f"{got[m]['spans']:.0f} spans" for m in MODES), flush=True)
    finally:
        sink.close()
    for mode in MODES[1:]:
        ratios = [r[mode]["tpot_ms"] / r["off"]["tpot_ms"] for r in rounds]
        print(f"{mode}: TPOT {statistics.median(ratios):.3f}x untraced (rounds: "
              f"{', '.join(f'{x:.3f}' for x in ratios)})")
    traced = rounds[0]["ratio 1"]
    print(f"spans per traced request: {traced['spans'] / traced['requests']:.1f} "
          f"(5 to 8 by where its prompt ran); at ratio 0: "
          f"{sum(r['ratio 0']['spans'] for r in rounds):.0f}")
    request_s = statistics.median(r["off"]["tpot_ms"] for r in rounds) / 1e3 * args.max_tokens
    sink = OtlpReceiver()
    try:
        work = {ratio: tracing_work_s(sink, ratio) for ratio in (0.0, 1.0)}
    finally:
        sink.close()
    for ratio, s in work.items():
        print(f"tracing's own work at ratio {ratio:g}: {s * 1e6:.0f} us per request, "
              f"{s / request_s:.4%} of a {args.max_tokens}-token request's {request_s:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "work_s": work}, f, indent=2)


if __name__ == "__main__":
    main()
