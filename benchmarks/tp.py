"""``make bench`` for tensor parallelism: the same engine at TP=1 and TP=N ranks (one
thread per rank), measured in one run.

- TTFT of long prompts (default 2K and 8K tokens): prefill is compute-bound, so N
  ranks on N cores should cut it by up to N;
- single-stream decode ms/token, and how much of a step rank 0 spends in
  collectives (all-reduces, the logits gather, the token broadcast -- waiting for a
  slower rank included).

Each figure prints with its TP=1 reference as a ratio. Run: ``python -m
benchmarks.tp [--model DIR] [--ranks 2] [--dtype float32]
[--prefill 2048,8192] [--new-tokens 64]``.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.engine import random_prompts
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.gguf_convert import resolve_model
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.worker.tensor_parallel import create_engine


def measure(model: str | None, ranks: int, dtype: str, prefill: list[int], new_tokens: int,
            ) -> dict[str, float]:
    engine = create_engine(resolve_model(model), EngineConfig(
        dtype=dtype, num_threads=1, tensor_parallel_size=ranks,
        max_num_batched_tokens=max(prefill), num_blocks=max(prefill) // 16 + 16))
    try:
        vocab = engine.model_config.vocab_size
        engine.generate(random_prompts(1, 16, vocab), SamplingParams(max_tokens=4))  # warm
        out: dict[str, float] = {}
        for n in prefill:  # (a prompt of the whole context leaves no room: one token less)
            length = min(n, engine.max_model_len - 1)
            t0 = time.perf_counter()
            engine.generate(random_prompts(1, length, vocab, seed=n), SamplingParams(max_tokens=1))
            out[f"ttft_{n}_ms"] = (time.perf_counter() - t0) * 1e3
        prompt = random_prompts(1, 128, vocab, seed=1)
        engine.generate(prompt, SamplingParams(max_tokens=2))
        before = engine.tp.collective_s if engine.tp else 0.0
        t0 = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        out["decode_ms"] = seconds / new_tokens * 1e3
        spent = (engine.tp.collective_s - before) if engine.tp else 0.0
        out["collective_ms_per_step"] = spent / new_tokens * 1e3
        return out
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    prefill = [int(x) for x in args.prefill.split(",")]
    ref = measure(args.model, 1, args.dtype, prefill, args.new_tokens)
    tp = measure(args.model, args.ranks, args.dtype, prefill, args.new_tokens)
    print(f"tensor parallel, {args.dtype}, one thread per rank: TP=1 vs TP={args.ranks}")
    for n in prefill:
        a, b = ref[f"ttft_{n}_ms"], tp[f"ttft_{n}_ms"]
        print(f"  TTFT {n:>5} tokens   {a:9.0f} ms  {b:9.0f} ms   speed-up {a / b:4.2f}x")
    a, b = ref["decode_ms"], tp["decode_ms"]
    print(f"  decode ms/token     {a:9.1f}     {b:9.1f}      speed-up {a / b:4.2f}x "
          f"(collectives {tp['collective_ms_per_step']:.1f} ms of each TP step)")


if __name__ == "__main__":
    main()
