"""``make bench`` for structured outputs: what a grammar costs, measured in one run.

- the grammar engine alone (llguidance): building a matcher for a schema seen for
  the first time (compile) and for a cached one, and the per-token mask time (p50,
  p99, mean) along a sampled valid JSON;
- the engine at N concurrent streams (default 32) with a JSON schema on every
  request against the same load without one: output tokens/s and the ratio (each
  unconstrained request generates exactly as many tokens as its constrained twin,
  so both runs do the same work apart from the grammar);
- first-token latency of one request: no schema, a cold schema (never seen by this
  process), a cached schema.

Run: ``python -m benchmarks.structured [--model DIR] [--threads 1]
[--concurrency 32] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.grammar import bitmask_words
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array", "minItems": 3, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                    "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 10},
                },
                "required": ["name", "age", "city", "role", "score"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "List three people with their name, age, city, "
                                      "job and a score, as JSON."}]


def mask_times(eng: LLMEngine, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    """Matcher build (cold, cached) and per-token mask time along ``tokens``."""
    eng.grammars.warm()
    s = StructuredOutput.json_schema({**schema, "description": f"cold {time.time_ns()}"})
    t0 = time.perf_counter()
    eng.grammars.matcher(SamplingParams(structured=s), [0])
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = eng.grammars.matcher(SamplingParams(structured=s), [0])
    cached = time.perf_counter() - t0
    assert m is not None
    mask = torch.empty((1, bitmask_words(eng.grammars.vocab_size)), dtype=torch.int32)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        times.append(time.perf_counter() - t0)
        if not m.consume_token(t):
            break
    times.sort()
    return {"matcher_cold_ms": cold * 1e3, "matcher_cached_ms": cached * 1e3,
            "mask_p50_us": statistics.median(times) * 1e6,
            "mask_p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6,
            "mask_mean_us": statistics.fmean(times) * 1e6, "tokens": len(times)}


def throughput(eng: LLMEngine, prompt: list[int], n: int, max_tokens: int,
               rounds: int = 2) -> dict[str, float]:
    """Output tokens/s of n constrained streams, and of n unconstrained ones that
    generate the same number of tokens each; the runs alternate, best of ``rounds``."""
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i,
                                  structured=StructuredOutput.json_schema(PEOPLE))
                   for i in range(n)]
    eng.generate([prompt], constrained[0])  # warm: grammar compiled, kernels touched
    t_con = t_plain = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = eng.generate([prompt] * n, constrained)
        t_con = min(t_con, time.perf_counter() - t0)
        lengths = [len(o.token_ids) for o in outs]
        plain = [SamplingParams(max_tokens=k, temperature=0.8, seed=i, ignore_eos=True)
                 for i, k in enumerate(lengths)]
        t0 = time.perf_counter()
        eng.generate([prompt] * n, plain)
        t_plain = min(t_plain, time.perf_counter() - t0)
    total = sum(lengths)
    return {"constrained_tok_s": total / t_con, "plain_tok_s": total / t_plain,
            "ratio": t_plain / t_con, "valid": sum(1 for o in outs if _parses(o.text)),
            "n": n, "mean_tokens": total / n}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def first_token(eng: LLMEngine, prompt: list[int]) -> dict[str, float]:
    def ttft(params: SamplingParams) -> float:
        t0 = time.perf_counter()
        eng.generate([prompt], params)
        return time.perf_counter() - t0

    ttft(SamplingParams(max_tokens=1))  # warm
    plain = min(ttft(SamplingParams(max_tokens=1)) for _ in range(3))
    cold = [ttft(SamplingParams(max_tokens=1, structured=StructuredOutput.json_schema(
        {**PEOPLE, "description": f"cold {time.time_ns()}"}))) for _ in range(3)]
    cached = min(ttft(SamplingParams(max_tokens=1,
                                     structured=StructuredOutput.json_schema(PEOPLE)))
                 for _ in range(3))
    return {"plain_ms": plain * 1e3, "cold_schema_ms": min(cold) * 1e3,
            "cached_schema_ms": cached * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pdserve.engine.model.gguf_convert import resolve_model

    model_dir = resolve_model(args.model)
    eng = LLMEngine(model_dir, EngineConfig(num_threads=args.threads))
    assert eng.tokenizer is not None
    prompt = eng.tokenizer.apply_chat_template(PROMPT)
    print(f"model: {model_dir}, {args.threads} thread(s), llguidance "
          f"{importlib.metadata.version('llguidance')}")
    results: dict[str, Any] = {}

    print("\n== grammar engine: matcher build and per-token mask")
    sample = eng.generate([prompt], SamplingParams(
        max_tokens=args.max_tokens, temperature=0.8, seed=0,
        structured=StructuredOutput.json_schema(PEOPLE)))[0]
    r = mask_times(eng, PEOPLE, sample.token_ids)
    results["grammar"] = r
    print(f"   matcher cold {r['matcher_cold_ms']:.2f} ms, cached "
              f"{r['matcher_cached_ms']:.2f} ms; mask p50 {r['mask_p50_us']:.0f} us, p99 "
              f"{r['mask_p99_us']:.0f} us, mean {r['mask_mean_us']:.0f} us "
              f"over {r['tokens']} tokens")

    print(f"\n== engine, {args.concurrency} concurrent streams, a schema on every request")
    r = throughput(eng, prompt, args.concurrency, args.max_tokens)
    results["throughput"] = r
    print(f"   with schema {r['constrained_tok_s']:.1f} tok/s, without "
          f"{r['plain_tok_s']:.1f} tok/s: ratio {r['ratio']:.3f} (goal >= 0.95); "
          f"{r['valid']}/{r['n']} outputs parse, {r['mean_tokens']:.0f} tokens each")

    print("\n== first-token latency of one request")
    r = first_token(eng, prompt)
    results["first_token"] = r
    print(f"   no schema {r['plain_ms']:.1f} ms, cold schema {r['cold_schema_ms']:.1f} ms "
          f"(+{r['cold_schema_ms'] - r['plain_ms']:.1f}), cached schema "
          f"{r['cached_schema_ms']:.1f} ms (+{r['cached_schema_ms'] - r['plain_ms']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
