"""``make bench`` for the KV cache's formats (``kv_cache_dtype``): what the same memory
holds and what a decode step costs at long context, bfloat16 against int8, one run.

- capacity: an engine with ``--kv-mib`` of KV cache runs ``--requests`` requests of
  ``--prompt`` + ``--new`` tokens at once; blocks, the most requests running together,
  preemptions;
- decode: the time of one decode step (prefill excluded) with ``batch`` requests of
  ``--context`` tokens each, best of 3 interleaved rounds.

Run: ``python -m benchmarks.kv_cache [--model DIR] [--threads 1] [--kv-mib 64]
[--context 1024] [--batches 1,8,32] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams

FORMATS = ("bfloat16", "int8")
_ids = itertools.count()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]


def capacity(eng: LLMEngine, prompts: list[list[int]], new: int) -> dict[str, int]:
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for p in prompts:
        eng.add_request(f"c{next(_ids)}", p, params)
    peak = 0
    preempted = eng.scheduler.num_preemptions
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, len(eng.scheduler.running))
    return {"blocks": eng.num_blocks, "peak_running": peak,
            "preemptions": eng.scheduler.num_preemptions - preempted}


def decode_step_s(eng: LLMEngine, batch: int, context: int, steps: int = 24) -> float:
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for p in _prompts(batch, context, seed=batch):
        eng.add_request(f"d{next(_ids)}", p, params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < context
                                       for r in eng.scheduler.running):
        eng.step()
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    took = (time.perf_counter() - t0) / steps
    while eng.has_unfinished():
        eng.step()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pdserve.engine.model.gguf_convert import resolve_model

    model_dir = resolve_model(args.model)
    torch.set_num_threads(args.threads)

    def make(kv: str, kv_bytes: int) -> LLMEngine:
        return LLMEngine(model_dir, EngineConfig(
            dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes=kv_bytes,
            num_threads=args.threads, max_num_seqs=64, enable_prefix_caching=False))

    print(f"model {model_dir.name}, bfloat16 weights, {args.threads} thread(s)")
    print(f"-- {args.kv_mib} MiB of KV, {args.requests} requests of {args.prompt} + "
          f"{args.new} tokens")
    caps: dict[str, dict[str, int]] = {}
    for kv in FORMATS:
        cap = caps[kv] = capacity(make(kv, args.kv_mib << 20),
                                  _prompts(args.requests, args.prompt, seed=0), args.new)
        print(f"   {kv:9} {cap['blocks']:5} blocks, {cap['peak_running']:3} requests at once, "
              f"{cap['preemptions']} preemptions")
    print(f"   int8 holds {caps['int8']['peak_running'] / caps['bfloat16']['peak_running']:.2f}x "
          f"the requests")
    engines = {kv: make(kv, 1 << 30) for kv in FORMATS}
    decode: dict[str, dict[int, float]] = {kv: {} for kv in FORMATS}
    print(f"-- decode step at {args.context} tokens of context (best of 3)")
    for batch in (int(b) for b in args.batches.split(",")):
        for _ in range(3):
            for kv, eng in engines.items():
                ms = decode_step_s(eng, batch, args.context) * 1e3
                decode[kv][batch] = min(decode[kv].get(batch, ms), ms)
        bf, q = decode["bfloat16"][batch], decode["int8"][batch]
        print(f"   batch {batch:3}: bfloat16 {bf:6.1f} ms, int8 {q:6.1f} ms ({bf / q:.2f}x)",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {kv: {"capacity": caps[kv], "decode_ms": decode[kv]} for kv in FORMATS},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
