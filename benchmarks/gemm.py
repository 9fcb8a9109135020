"""``make bench`` for the linear layers: every GEMM family this CPU runs, against its
own measured peak and against torch's ``F.linear`` (oneDNN / MKL) in the same run.

Per thread count, weight dtype and family (``kernels.DENSE_FAMILIES``), on the default
model's layer shapes (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536):

- GFLOP/s of one layer's matmuls at 1, 8, 32, 128 and 1024 rows, weights hot in
  cache, as a fraction of the family's arithmetic peak (``family_peak``: a register-
  only loop of its instruction, times the threads) and against ``F.linear`` on the
  same shapes (bfloat16 in and out for bfloat16 weights, as vLLM's CPU build runs);
- decode bandwidth: one row through 30 layers' weights (larger than the caches), as
  GB/s of weights read and a fraction of the memory read bandwidth measured here;
- which family ``linear_backend: cpu`` picks;
- the integer families (``kernels.INT_FAMILIES``) for W8A8 (``quantization: w8a8``), int4
  and int8 (Q4_1 / Q8_0 weights x int8 activations) the same way, against their
  integer peak (``w8a8_peak``: vpmaddwd on avx2, vpdpbusd on avx512vnni) and bf16
  ``F.linear``, and int4's and int8's decode bandwidth.

Run: ``python -m benchmarks.gemm [--threads 1,2] [--rows 1,8,32,128,1024]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.engine import memory_read_bandwidth
from pdserve.engine import kernels
from pdserve.engine.kernels import family_id
from pdserve.engine.model.linear import (
    CpuDense,
    CpuQuantized,
    CpuW8A8,
    blocks_family,
    cpu_families,
    int_families,
    resolve_linear_backend,
)
from pdserve.engine.model.quant import quantize, quantize_w8

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of the default model


def best_seconds(fn: Callable[[], object], min_time: float = 0.3) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_time:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def run_layers(fns: list[Callable[[torch.Tensor], torch.Tensor]],
               xs: dict[int, torch.Tensor]) -> None:
    """Each of ``fns`` (the layers ``LAYER`` repeated) on the x of its input width."""
    for fn, (_, k) in zip(fns, LAYER * (len(fns) // len(LAYER)), strict=True):
        fn(xs[k])


def layer_flops(rows: int) -> float:
    return float(sum(2 * rows * n * k for n, k in LAYER))


def bench(threads: int, rows: list[int]) -> None:
    torch.set_num_threads(threads)
    k = kernels.require()
    bw = memory_read_bandwidth()
    print(f"\n== {threads} thread(s): memory read bandwidth {bw / 1e9:.1f} GB/s")
    for dtype in (torch.float32, torch.bfloat16):
        chosen = resolve_linear_backend("cpu", "cpu", dtype, (576,))
        print(f"-- {dtype} weights: linear_backend cpu -> {chosen}")
        g = torch.Generator().manual_seed(0)
        weights = [(torch.randn(n, kk, generator=g) * 0.05).to(dtype) for n, kk in LAYER]
        for family in cpu_families(dtype):
            peak = k.family_peak(family_id(family)) * threads
            layer: list[Callable[[torch.Tensor], torch.Tensor]] = [
                CpuDense(w, None, family) for w in weights]
            ref_layer: list[Callable[[torch.Tensor], torch.Tensor]] = [
                partial(F.linear, weight=w) for w in weights]
            cells = []
            for m in rows:
                xs = {kk: torch.randn(m, kk, generator=g) for kk in (576, 1536)}
                ours = best_seconds(partial(run_layers, layer, xs))
                ref = best_seconds(partial(run_layers, ref_layer,
                                           {kk: x.to(dtype) for kk, x in xs.items()}))
                gf = layer_flops(m) / ours
                cells.append(f"{m} rows {gf / 1e9:5.0f} GFLOP/s ({gf / peak:4.0%}, "
                             f"{ref / ours:4.2f}x F.linear)")
            print(f"   {family:<11} peak {peak / 1e9:4.0f} GFLOP/s | " + " | ".join(cells))
            deep: list[Callable[[torch.Tensor], torch.Tensor]] = [
                CpuDense(w, None, family) for _ in range(30) for w in weights]
            x1 = {kk: torch.randn(1, kk, generator=g) for kk in (576, 1536)}
            t = best_seconds(partial(run_layers, deep, x1))
            nbytes = 30 * sum(n * kk for n, kk in LAYER) * weights[0].element_size()
            print(f"   {family:<11} decode, 1 row over {nbytes / 1e6:.0f} MB of weights: "
                  f"{nbytes / t / 1e9:.1f} GB/s ({nbytes / t / bw:.0%} of memory bandwidth)")
            del deep


def bench_integer(threads: int, rows: list[int], kind: str) -> None:
    """The integer families for ``kind`` (``w8a8``, ``int4``, ``int8``) against their
    integer peak and bf16 ``F.linear`` (same shapes); int4 / int8 also their decode
    bandwidth."""
    k = kernels.require()
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(n, kk, generator=g) * 0.05 for n, kk in LAYER]
    ref_layer: list[Callable[[torch.Tensor], torch.Tensor]] = [
        partial(F.linear, weight=w.bfloat16()) for w in weights]
    families = [f for f in int_families() if kind == "w8a8" or f == blocks_family(f)]
    what = {"w8a8": "W8A8 (int8 x int8, quantization: w8a8)",
            "int4": "int4 (Q4_1 x int8, quantization: int4)",
            "int8": "int8 (Q8_0 x int8, quantization: int8)"}[kind]
    print(f"-- {what}: families {', '.join(families)}")

    def make(w: torch.Tensor, family: str) -> Callable[[torch.Tensor], torch.Tensor]:
        if kind == "w8a8":
            return CpuW8A8(quantize_w8(w), None, family)
        return CpuQuantized(quantize(w, kind), None, family)

    for family in families:
        peak = k.w8a8_peak(family_id(family)) * threads
        layer: list[Callable[[torch.Tensor], torch.Tensor]] = [make(w, family) for w in weights]
        cells = []
        for m in rows:
            xs = {kk: torch.randn(m, kk, generator=g) for kk in (576, 1536)}
            ours = best_seconds(partial(run_layers, layer, xs))
            ref = best_seconds(partial(run_layers, ref_layer,
                                       {kk: x.bfloat16() for kk, x in xs.items()}))
            ops = layer_flops(m) / ours
            cells.append(f"{m} rows {ops / 1e9:5.0f} GOP/s ({ops / peak:4.0%}, "
                         f"{ref / ours:4.2f}x bf16 F.linear)")
        print(f"   {family:<11} peak {peak / 1e9:4.0f} GOP/s | " + " | ".join(cells))
        if kind != "w8a8":
            deep = [make(w, family) for _ in range(30) for w in weights]
            x1 = {kk: torch.randn(1, kk, generator=g) for kk in (576, 1536)}
            t = best_seconds(partial(run_layers, deep, x1))
            per_block = 20 if kind == "int4" else 36  # bytes per 32 weights, packed
            nbytes = 30 * sum(n * kk for n, kk in LAYER) * per_block // 32
            bw = memory_read_bandwidth()
            print(f"   {family:<11} decode, 1 row over {nbytes / 1e6:.0f} MB of weights: "
                  f"{nbytes / t / 1e9:.1f} GB/s ({nbytes / t / bw:.0%} of memory bandwidth)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,8,32,128,1024")
    args = ap.parse_args()
    flags = sorted(f for f in kernels.cpu_flags()
                   if f.startswith(("avx512", "avx2", "fma", "amx")) or "vnni" in f)
    print(f"CPU flags: {' '.join(flags)}")
    for threads in (int(t) for t in args.threads.split(",")):
        bench(threads, [int(r) for r in args.rows.split(",")])
        for kind in ("w8a8", "int4", "int8"):
            bench_integer(threads, [int(r) for r in args.rows.split(",")], kind)


if __name__ == "__main__":
    main()
