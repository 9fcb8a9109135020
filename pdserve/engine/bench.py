"""``make bench`` for the engine: decode speed against the machine's memory
bandwidth and against Hugging Face transformers, measured in the same run.

Prints, per dtype and thread count:
- single-stream decode ms/token, achieved weight bandwidth (weight bytes x tokens/s)
  and its ratio to the memory read bandwidth measured just before;
- output tokens/s with 1, 8 and 32 concurrent requests (128-token prompts, 128 new);
- the same for transformers ``generate`` on the same weights, and the ratios.

Run: ``python -m pdserve.engine.bench [--model DIR] [--dtypes float32,bfloat16]
[--threads 1,2] [--concurrency 1,8,32] [--no-hf]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cost import cost_model
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


def memory_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming reduction over a buffer much larger than the caches."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def engine_single_stream(eng: LLMEngine, prompt: list[int], new: int) -> float:
    """Seconds per decoded token (prefill excluded)."""
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    eng.add_request("single", prompt, params)
    eng.step()  # prefill + first token
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return (time.perf_counter() - t0) / (new - 1)


def engine_throughput(eng: LLMEngine, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def hf_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    m.generation_config.eos_token_id = None
    return m.eval()


def hf_single_stream(model: torch.nn.Module, prompt: list[int], new: int) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)  # type: ignore[operator]
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, do_sample=False)  # type: ignore[operator]
    return (time.perf_counter() - t0 - prefill) / (new - 1)


def hf_throughput(model: torch.nn.Module, prompts: list[list[int]], new: int) -> float:
    t0 = time.perf_counter()
    out = model.generate(torch.tensor(prompts), max_new_tokens=new,  # type: ignore[operator]
                         do_sample=False)
    return (out.shape[0] * (out.shape[1] - len(prompts[0]))) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    args = ap.parse_args()
    from pdserve.engine.gguf_convert import resolve_model

    model_dir = resolve_model(args.model)
    conc = [int(c) for c in args.concurrency.split(",")]
    print(f"model: {model_dir}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bw = memory_read_bandwidth()
        print(f"\n== {threads} thread(s): memory read bandwidth {bw / 1e9:.1f} GB/s")
        for dtype in args.dtypes.split(","):
            eng = LLMEngine(model_dir, EngineConfig(dtype=dtype, num_threads=threads,
                                                    max_num_seqs=max(conc)))
            # Bytes a decode step must read: every matmul weight once, LM head included
            # (the embedding lookup reads one row).
            cost = cost_model(eng.model_config, dtype)
            weight_bytes = (cost.num_layers * cost.linear_params_per_layer
                            + cost.head_params) * cost.dtype_bytes
            vocab = eng.model_config.vocab_size
            prompt = random_prompts(1, args.prompt_len, vocab)[0]
            engine_single_stream(eng, prompt, 8)  # warm-up
            spt = engine_single_stream(eng, prompt, args.new_tokens)
            achieved = weight_bytes / spt
            print(f"-- {dtype}: weights {weight_bytes / 1e6:.0f} MB")
            print(f"   pdserve single-stream decode: {spt * 1e3:.1f} ms/token, weight bandwidth "
                  f"{achieved / 1e9:.1f} GB/s = {achieved / bw:.0%} of measured memory bandwidth")
            hf = None if args.no_hf else hf_model(model_dir, eng.config.torch_dtype)
            if hf is not None:
                hspt = hf_single_stream(hf, prompt, min(args.new_tokens, 64))
                print(f"   transformers single-stream:   {hspt * 1e3:.1f} ms/token "
                      f"(pdserve is {hspt / spt:.2f}x faster)")
            for c in conc:
                ps = random_prompts(c, args.prompt_len, vocab, seed=c)
                tps = engine_throughput(eng, ps, args.new_tokens)
                line = f"   {c:>3} concurrent: pdserve {tps:7.1f} tok/s"
                if hf is not None:
                    htps = hf_throughput(hf, ps, args.new_tokens)
                    line += f" | transformers {htps:7.1f} tok/s | ratio {tps / htps:.2f}x"
                print(line, flush=True)
            eng.check_integrity()
            del eng, hf


if __name__ == "__main__":
    main()
