"""Model FLOPs and memory bytes per engine step, and the device peaks they are
compared with (MFU = achieved / peak FLOP/s, MBU = achieved / peak bytes/s).

This module owns the device peak table and the CPU peak measurement (torch is
imported lazily, inside ``measure_peaks``). The per-step costs they are compared
with come from ``pdserve.engine.cost``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePeaks:
    """What one worker's devices can do at best: all its tensor-parallel ranks together
    (the step costs MFU/MBU divide are the whole model's, which the ranks share)."""

    device: str  # one rank's device, e.g. "NVIDIA H200", "cpu (4 threads)"
    flops_per_s: float  # dense matmul FLOP/s in the serving dtype, all ranks
    bytes_per_s: float  # memory (HBM / DRAM) bandwidth, all ranks
    source: str  # "datasheet" | "measured"
    ranks: int = 1  # tensor-parallel ranks the peaks cover

    def times(self, ranks: int) -> DevicePeaks:
        """These peaks for a worker of ``ranks`` times as many ranks (one rank's peaks
        -> a tensor-parallel worker's: each rank has its own device, or threads)."""
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        return dataclasses.replace(self, flops_per_s=self.flops_per_s * ranks,
                                   bytes_per_s=self.bytes_per_s * ranks,
                                   ranks=self.ranks * ranks)


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


def detect_peaks(dtype: str = "float32", ranks: int = 1) -> DevicePeaks:
    """A worker of ``ranks`` tensor-parallel ranks whose rank 0 is this process: this
    process's device (the datasheet row for a known GPU, else a measurement with this
    process's threads, which are one rank's) times ``ranks``. On CPU the ranks share the
    node's DRAM, so ``ranks`` x one rank's measured bandwidth is an upper bound (MBU
    against it reads low once the ranks together saturate the memory channels)."""
    import torch

    if torch.cuda.is_available():
        known = lookup_device(torch.cuda.get_device_name())
        one = known or measure_peaks("cuda", "bfloat16")
    else:
        one = measure_peaks("cpu", dtype)
    return one.times(ranks)
