"""Model FLOPs and memory bytes per engine step, and the device peaks they are
compared with (MFU = achieved / peak FLOP/s, MBU = achieved / peak bytes/s).

This module owns the cost model and the peak table. The cost part is pure Python
(workers call ``cost_model(...).step(...)`` after each step; no torch, no
Prometheus); only ``measure_peaks`` imports torch, lazily.

Cost of one step (``StepInfo`` + the model's shape; ``L`` layers, hidden ``h``,
``Hq`` query heads of ``d`` dims, ``Hkv`` KV heads, MLP width ``i``, vocab ``V``,
``b`` bytes per element of the engine dtype)::

    linear params per layer  P = h·(Hq·d + 2·Hkv·d) + Hq·d·h + 3·h·i
    FLOPs = 2·L·P·num_tokens            every computed token through every matmul
          + 2·h·V·num_sampled           the LM head, only on rows that sample
          + 4·L·Hq·d·attended           QKᵀ and PV: 2 FLOPs per multiply-add each
    bytes = b·(L·P + [num_sampled>0]·h·V)          weights, read once per step
          + b·2·L·Hkv·d·context_tokens             K and V of every attended token

``attended`` = Σ over the step's new tokens of the tokens each attends (causal, itself
included): a sequence with ``c`` tokens already computed and ``n`` new ones adds
``n·c + n(n+1)/2``. ``StepInfo`` carries sums over sequences, so ``attended`` is
estimated by giving every sequence the mean prior context and every multi-token chunk
the mean chunk length; it is exact for all-decode steps (the decode pool), for
single-sequence steps, and for equal fresh chunks. Norms, rope, softmax, sampling and
activations are left out (under 1% for the models served here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.engine import StepInfo

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DevicePeaks:
    """What one worker's device can do at best."""

    device: str  # e.g. "NVIDIA H200", "cpu (4 threads)"
    flops_per_s: float  # dense matmul FLOP/s in the serving dtype
    bytes_per_s: float  # memory (HBM / DRAM) bandwidth
    source: str  # "datasheet" | "measured"


# Datasheet peaks per GPU: dense BF16 tensor-core FLOP/s (NVIDIA quotes 2x "with
# sparsity"; MFU uses dense) and HBM bandwidth. Matched against
# ``torch.cuda.get_device_name()`` by substring, first match wins, so the more
# specific names come first.
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989e12, 3.35e12),  # H100 SXM5 80GB HBM3
    ("H200 NVL", 835e12, 4.8e12),
    ("H200", 989e12, 4.8e12),  # H200 SXM 141GB HBM3e
    ("A100 80GB PCIe", 312e12, 1.935e12),
    ("A100-SXM4-80GB", 312e12, 2.039e12),
    ("A100", 312e12, 2.039e12),
    ("B200", 2.25e15, 8.0e12),  # HGX B200
)


def lookup_device(name: str) -> DevicePeaks | None:
    """The datasheet peaks for a GPU name, or ``None`` when it is not in the table."""
    for key, flops, bw in DEVICE_PEAKS:
        if key.lower() in name.lower():
            return DevicePeaks(name, flops, bw, "datasheet")
    return None


@dataclass(frozen=True)
class CostModel:
    """Per-step FLOPs and bytes of one model in one dtype (see the module docstring)."""

    num_layers: int
    linear_params_per_layer: int
    head_params: int  # LM head: h·V
    attn_flops_per_pair: int  # 4·L·Hq·d: one new token attending one context token
    kv_bytes_per_token: int  # K+V of one token, all layers
    dtype_bytes: int

    def flops(self, info: StepInfo, num_sampled: int) -> float:
        linear = 2 * self.num_layers * self.linear_params_per_layer * info.num_tokens
        return float(linear + 2 * self.head_params * num_sampled
                     + self.attn_flops_per_pair * attended_tokens(info))

    def bytes_read(self, info: StepInfo, num_sampled: int) -> float:
        params = self.num_layers * self.linear_params_per_layer
        if num_sampled:
            params += self.head_params
        return float(params * self.dtype_bytes + self.kv_bytes_per_token * info.context_tokens)

    def step(self, info: StepInfo, num_sampled: int) -> tuple[float, float]:
        """(model FLOPs, bytes read) of one step; ``num_sampled`` = rows that sampled."""
        return self.flops(info, num_sampled), self.bytes_read(info, num_sampled)


@lru_cache(maxsize=16)
def cost_model(model: ModelConfig, dtype: str) -> CostModel:
    """The cost model of ``model`` served in ``dtype`` (cached: workers call it per step)."""
    h, d, L = model.hidden_size, model.head_dim, model.num_layers
    q, kv = model.num_heads * d, model.num_kv_heads * d
    b = DTYPE_BYTES[dtype]
    return CostModel(
        num_layers=L,
        linear_params_per_layer=h * (q + 2 * kv) + q * h + 3 * h * model.intermediate_size,
        head_params=h * model.vocab_size,
        attn_flops_per_pair=4 * L * q,
        kv_bytes_per_token=2 * L * kv * b,
        dtype_bytes=b,
    )


def attended_tokens(info: StepInfo) -> float:
    """Σ over new tokens of the tokens each attends, estimated from the step's sums."""
    if info.num_seqs == 0:
        return 0.0
    prior = info.context_tokens - info.num_tokens  # tokens computed before this step
    per_seq_prior = prior / info.num_seqs
    # Σ n·c with every sequence at the mean prior context; Σ n(n+1)/2 with decodes
    # (n = 1) exact and the multi-token chunks at their mean length.
    chunks = info.num_seqs - info.num_decode
    chunk_tokens = info.num_tokens - info.num_decode
    triangle = float(info.num_decode)
    if chunks:
        mean = chunk_tokens / chunks
        triangle += chunks * mean * (mean + 1) / 2
    return per_seq_prior * info.num_tokens + triangle


def measure_peaks(device: str = "cpu", dtype: str = "float32", budget_s: float = 0.25,
                  stream_bytes: int = 64 << 20) -> DevicePeaks:
    """Measure matmul FLOP/s and streaming-read bandwidth on ``device`` with the
    process's torch threads; each measurement takes about ``budget_s`` seconds.
    Best of repeated runs (the ceiling this device reaches, as a datasheet would)."""
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def best_rate(work: float, fn: Callable[[], object]) -> float:
        fn()  # warm-up (allocations, thread pool start)
        sync()
        best, deadline = 0.0, time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            fn()
            sync()
            best = max(best, work / max(time.perf_counter() - t0, 1e-9))
        return best

    n = 1024 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    flops = best_rate(2.0 * n ** 3, lambda: torch.mm(a, b))
    a = b = torch.empty(0)
    # A buffer much larger than the last-level cache, read once per run.
    buf = torch.ones(stream_bytes // 4, dtype=torch.float32, device=device)
    bandwidth = best_rate(float(stream_bytes), lambda: buf.sum())
    buf = torch.empty(0)  # free it now: the worker keeps running in this process
    if device == "cpu":
        name = f"cpu ({torch.get_num_threads()} threads)"
    else:
        name = torch.cuda.get_device_name(torch.device(device))
    return DevicePeaks(name, flops, bandwidth, "measured")


def detect_peaks(dtype: str = "float32") -> DevicePeaks:
    """This process's device: the datasheet row for a known GPU, else a measurement."""
    import torch

    if torch.cuda.is_available():
        known = lookup_device(torch.cuda.get_device_name())
        return known or measure_peaks("cuda", "bfloat16")
    return measure_peaks("cpu", dtype)
