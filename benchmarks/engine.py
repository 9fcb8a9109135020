"""``make bench`` for the engine: decode, throughput and prefill against the
machine's own limits and against Hugging Face transformers, measured in one run.

Per thread count, and per weight format (float32, bfloat16, int8, int4, w8a8):

- single-stream decode ms/token, the weight bytes one step reads and that rate as
  a fraction of the memory read bandwidth measured just before;
- output tokens/s with 1, 8 and 32 concurrent requests (128-token prompts);
- prefill: TTFT, tokens/s and MFU (model FLOPs / the peak of the linear layers'
  kernel family, ``benchmarks.gemm``; torch's float32 matmul peak on the reference
  path) for 128, 1024 and 4096-token prompts;
- a per-op profile of a decode step through the per-layer Python loop (calls per
  step; share of time in matmuls, attention and everything else; served engines
  run the layers as one C++ call, ``csrc/decoder.cpp``);
- transformers' single-stream, throughput and prefill on the same weights, and
  every pdserve figure as a ratio against its reference.

Run: ``python -m benchmarks.engine [--model DIR] [--threads 1,2]
[--formats float32,bfloat16,int8,int4] [--concurrency 1,8,32] [--prefill 128,1024,4096]
[--prompt-len 128] [--kv-cache-dtype auto|int8] [--linear-backend cpu-FAMILY]
[--attention-backend cpu-FAMILY] [--no-hf]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.engine import kernels
from pdserve.engine.config import EngineConfig
from pdserve.engine.cost import cost_model
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kernels import DENSE_FAMILIES, family_id
from pdserve.engine.model.linear import Linear, blocks_family, int_family
from pdserve.engine.sampling.sampling_params import SamplingParams

# weight format -> (engine dtype, quantization)
FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
           "int8": ("float32", "int8"), "int4": ("float32", "int4"),
           "w8a8": ("bfloat16", "w8a8")}


def _best_seconds(fn: Callable[[], object], device: str, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5,
                          device: str = "cpu") -> float:
    """Bytes/s of a streaming reduction over a buffer much larger than the caches."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / _best_seconds(buf.sum, device, repeats)


def matmul_peak(dtype: torch.dtype, n: int = 1536, repeats: int = 4,
                device: str = "cpu") -> float:
    """FLOP/s of a large square matmul: the compute ceiling MFU is measured against."""
    if device == "cuda":
        n = 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, device, repeats)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def engine_single_stream(eng: LLMEngine, prompt: list[int], new: int) -> float:
    """Seconds per decoded token (prefill excluded)."""
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    eng.add_request("single", prompt, params)
    while eng.requests["single"].num_output_tokens == 0:
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


def engine_prefill(eng: LLMEngine, prompt: list[int]) -> float:
    """Seconds to the first token of an unloaded prompt (no prefix-cache hit)."""
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1))
    return time.perf_counter() - t0


@dataclass
class OpProfile:
    """Where a decode step's time goes (one request; wrappers time every call)."""

    calls_per_step: dict[str, float] = field(default_factory=dict)
    ms_per_step: dict[str, float] = field(default_factory=dict)
    step_ms: float = 0.0

    def shares(self) -> dict[str, float]:
        return {k: v / self.step_ms for k, v in self.ms_per_step.items()}


def profile_decode(eng: LLMEngine, prompt: list[int], steps: int = 32) -> OpProfile:
    """Time matmuls, attention and the fused ops over ``steps`` decode steps of one
    request. Leaves ``eng`` instrumented: profile last, on an engine you drop."""
    seconds: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            seconds[label] += time.perf_counter() - t0
            calls[label] += 1
            return out
        return run

    model = eng.model
    model.decoder = None  # the per-layer loop, whose kernels the wrappers can time
    for m in model.modules():
        if isinstance(m, Linear) and m.kernel is not None:
            m.kernel = timed(m.kernel, "lm head" if m is model.lm_head else "matmuls")
        if isinstance(m, Linear) and m.fused_silu_mul is not None:  # gate/up + SiLU·mul
            m.fused_silu_mul = timed(m.fused_silu_mul, "matmuls")
    assert model.attn is not None
    model.attn = timed(model.attn, "attention")
    for name in ("rms_norm", "add_rms_norm", "silu_mul"):
        setattr(model.ops, name, timed(getattr(model.ops, name), "norms + SiLU"))
    eng.add_request("profile", prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    seconds.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    total = time.perf_counter() - t0
    eng.abort("profile")
    prof = OpProfile(step_ms=total / steps * 1e3)
    for k in seconds:
        prof.ms_per_step[k] = seconds[k] / steps * 1e3
        prof.calls_per_step[k] = calls[k] / steps
    prof.ms_per_step["everything else"] = max(0.0, prof.step_ms - sum(prof.ms_per_step.values()))
    return prof


# ------------------------------------------------------------- transformers
def hf_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    m.generation_config.eos_token_id = None
    return m.eval()


def hf_single_stream(model: torch.nn.Module, prompt: list[int], new: int) -> float:
    ids = torch.tensor([prompt])
    prefill = hf_prefill(model, prompt)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                   max_new_tokens=new, do_sample=False)
    return (time.perf_counter() - t0 - prefill) / (new - 1)


def hf_throughput(model: torch.nn.Module, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                         max_new_tokens=new, do_sample=False)
    return (out.shape[0] * (out.shape[1] - len(prompts[0]))) / (time.perf_counter() - t0)


def hf_prefill(model: torch.nn.Module, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                   max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


# ------------------------------------------------------------------- report
@dataclass
class FormatResult:
    fmt: str
    threads: int
    decode_ms: float
    weight_mb: float
    bandwidth_fraction: float
    tokens_per_s: dict[int, float]  # concurrency -> output tokens/s
    ttft_ms: dict[int, float]  # prompt length -> unloaded TTFT
    prefill_mfu: dict[int, float]
    profile: dict[str, Any]


def bench_format(model_dir: Path, fmt: str, threads: int, bw: float, peak: float,
                 args: argparse.Namespace, hf: dict[str, Any]) -> FormatResult:
    dtype, quant = FORMATS[fmt]
    conc = [int(c) for c in args.concurrency.split(",")]
    longest = max(int(n) for n in args.prefill.split(","))

    def make() -> LLMEngine:
        return LLMEngine(model_dir, EngineConfig(
            dtype=dtype, quantization=quant, device=args.device,
            kv_cache_dtype=args.kv_cache_dtype, linear_backend=args.linear_backend,
            attention_backend=args.attention_backend,
            num_threads=threads if args.device == "cpu" else None, max_num_seqs=max(conc),
            enable_prefix_caching=False, max_num_batched_tokens=2048,
            max_model_len=max(longest + 64, 2048)))

    eng = make()
    family = eng.linear_backend.removeprefix("cpu-")
    if quant in ("int4", "int8", "w8a8") and family in DENSE_FAMILIES:  # the integer family's peak
        family = int_family(eng.config.linear_backend)
        if quant != "w8a8":
            family = blocks_family(family)
        peak = kernels.require().w8a8_peak(family_id(family)) * threads
    elif family in DENSE_FAMILIES:  # MFU against the chosen kernel family's own peak
        peak = kernels.require().family_peak(family_id(family)) * threads
    print(f"-- {fmt}: KV cache {eng.config.kv_cache_dtype}, linear backend "
          f"{eng.linear_backend}, kernels {family}, attention {eng.attention_backend}, "
          f"MFU against {peak / 1e9:.0f} GFLOP/s (GOP/s for integer kernels)")
    cost = cost_model(eng.model_config, dtype, quant)
    vocab = eng.model_config.vocab_size
    prompt = random_prompts(1, args.prompt_len, vocab)[0]
    engine_single_stream(eng, prompt, 8)  # warm-up
    spt = engine_single_stream(eng, prompt, args.new_tokens)
    frac = cost.step_weight_bytes / spt / bw
    print(f"-- {fmt}: {cost.step_weight_bytes / 1e6:.0f} MB of weights per decode step")
    line = (f"   single-stream decode {spt * 1e3:6.1f} ms/token = "
            f"{cost.step_weight_bytes / spt / 1e9:.1f} GB/s = {frac:.0%} of memory bandwidth")
    if "single" in hf:
        line += f" | transformers {hf['single'] * 1e3:.1f} ms ({hf['single'] / spt:.2f}x)"
    print(line)
    tps: dict[int, float] = {}
    for c in conc:
        tps[c] = engine_throughput(eng, random_prompts(c, args.prompt_len, vocab, seed=c),
                                   args.new_tokens)
        line = f"   {c:>3} concurrent {tps[c]:7.1f} tok/s"
        if c in hf.get("tps", {}):
            line += f" | transformers {hf['tps'][c]:7.1f} tok/s ({tps[c] / hf['tps'][c]:.2f}x)"
        print(line, flush=True)
    ttft: dict[int, float] = {}
    mfu: dict[int, float] = {}
    for n in (int(x) for x in args.prefill.split(",")):
        p = random_prompts(1, n, vocab, seed=n)[0]
        ttft[n] = engine_prefill(eng, p)
        flops = 2 * cost.num_layers * cost.linear_params_per_layer * n + 2 * cost.head_params \
            + cost.attn_flops_per_pair * n * (n + 1) / 2
        mfu[n] = flops / ttft[n] / peak
        line = (f"   prefill {n:>5} tokens: TTFT {ttft[n] * 1e3:7.0f} ms, "
                f"{n / ttft[n]:6.0f} tok/s, MFU {mfu[n]:.0%}")
        if n in hf.get("ttft", {}):
            line += f" | transformers {hf['ttft'][n] * 1e3:.0f} ms ({hf['ttft'][n] / ttft[n]:.2f}x)"
        print(line, flush=True)
    eng.check_integrity()
    del eng
    prof = profile_decode(make(), prompt)
    calls = sum(prof.calls_per_step.values())
    shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(prof.shares().items(),
                                                        key=lambda kv: -kv[1]))
    print(f"   decode step profile, per-layer loop ({prof.step_ms:.1f} ms, {calls:.0f} kernel "
          f"calls): {shares}")
    return FormatResult(fmt, threads, spt * 1e3, cost.step_weight_bytes / 1e6, frac, tps,
                        {k: v * 1e3 for k, v in ttft.items()}, mfu, asdict(prof))


def hf_reference(model_dir: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """transformers float32 on the same weights: the reference for every format."""
    model = hf_model(model_dir, torch.float32)
    prompt = random_prompts(1, args.prompt_len, vocab)[0]
    out: dict[str, Any] = {"single": hf_single_stream(model, prompt, min(args.new_tokens, 64))}
    out["tps"] = {c: hf_throughput(model, random_prompts(c, args.prompt_len, vocab, seed=c),
                                   args.new_tokens)
                  for c in (int(x) for x in args.concurrency.split(","))}
    out["ttft"] = {n: hf_prefill(model, random_prompts(1, n, vocab, seed=n)[0])
                   for n in (int(x) for x in args.prefill.split(",")) if n <= 1024}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default="float32,bfloat16,int8,int4,w8a8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prefill", default="128,1024,4096")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                    help="every format's KV cache (auto: as its dtype)")
    ap.add_argument("--linear-backend", default="auto",
                    help="force a GEMM family for every format (e.g. cpu-avx512bf16)")
    ap.add_argument("--attention-backend", default="auto",
                    help="force an attention family for every format (e.g. cpu-avx2)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (scripts/gpu_check.sh)")
    args = ap.parse_args()
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model.gguf_convert import resolve_model

    model_dir = resolve_model(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    print(f"model: {model_dir}")
    results: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bw = memory_read_bandwidth(device=args.device)
        peak_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        peak = matmul_peak(peak_dtype, device=args.device)
        print(f"\n== {args.device}, {threads} thread(s): memory read bandwidth "
              f"{bw / 1e9:.1f} GB/s, {peak_dtype} matmul peak {peak / 1e9:.0f} GFLOP/s")
        hf = {} if args.no_hf else hf_reference(model_dir, args, vocab)
        for fmt in args.formats.split(","):
            r = bench_format(model_dir, fmt, threads, bw, peak, args, hf)
            results.append({**asdict(r), "memory_bandwidth": bw, "matmul_peak": peak,
                            "transformers": hf})
        base = next((r for r in results if r["fmt"] == "bfloat16" and r["threads"] == threads),
                    None)
        if base is not None:
            ratios = ", ".join(f"{r['fmt']} {r['decode_ms'] / base['decode_ms']:.2f}x"
                               for r in results if r["threads"] == threads)
            print(f"   single-stream ms/token against bfloat16: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
