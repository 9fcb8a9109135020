"""Linear layers and the per-token ops around them, behind one backend switch.

``Linear`` holds its weight as the checkpoint gives it (``[out, in]``) and runs
through a kernel chosen once at load (``Linear.use``):

* ``torch`` -- ``F.linear`` in the model's dtype: the reference.
* ``cpu`` -- pdserve's C++ kernels on float32 activations (``csrc/linear.cpp``):
  batches of up to ``SMALL_M`` rows stream each weight once from memory and use it
  for every row (decode is memory-bound: the step time is the weight bytes over the
  memory bandwidth); larger batches (prefill) widen panels of a bfloat16 or
  quantized weight to float32 in cache and hand them to the BLAS, or call it
  directly for float32.

A quantized layer (``Linear.quantize``, formats in ``quant.py``) keeps only its
blocks; its reference is ``dequantize`` then ``F.linear``.

``LayerOps`` is the matching switch for RMSNorm (with the residual add fused) and
SiLU-and-multiply: ``TorchOps`` is the reference, ``CpuOps`` the fused kernels.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import kernels
from pdserve.engine.quant import QuantizedWeight, dequantize

# Up to this many rows the streaming kernel beats the BLAS (measured on the default
# model's matrices, 1 thread, bfloat16 weights: 31 ms for all matmuls at 8 rows
# against 65 ms through the widened BLAS path; float32: 44 against 72 ms).
SMALL_M = {torch.float32: 16, torch.bfloat16: 32}
SMALL_M_QUANT = {8: 32, 4: 32}
# Rows of a bfloat16 weight widened to float32 per BLAS call (stays in L2).
WIDEN_PANEL = 256


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """y = x @ weight.T + bias, weight [out, in] as checkpoints store it."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)
        self.kernel: LinearKernel | None = None  # None: the reference F.linear
        self.qweight: QuantizedWeight | None = None

    def quantize(self, qweight: QuantizedWeight) -> None:
        """Serve this layer from ``qweight``; the float weight is dropped."""
        if (qweight.out_features, qweight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight is {qweight.out_features}x{qweight.in_features}, "
                             f"the layer {self.out_features}x{self.in_features}")
        self.qweight = qweight
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def use(self, backend: str) -> None:
        """Pick the kernel (``torch`` or ``cpu``); called once after loading."""
        if self.qweight is not None:
            self.kernel = (CpuQuantized(self.qweight, self.bias) if backend == "cpu"
                           else TorchDequantized(self.qweight, self.bias))
        else:
            self.kernel = CpuDense(self.weight.data, self.bias) if backend == "cpu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)

    # Called ~120 times per decode step: skip nn.Module's hook machinery (~2 us a call).
    __call__ = forward


class CpuDense:
    """Dense float32 / bfloat16 weight, float32 activations in and out. Large
    bfloat16 batches run in bfloat16 through oneDNN where the CPU multiplies bfloat16
    natively (``native_bf16``), else widened to float32 for the BLAS."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 native_bf16: bool | None = None) -> None:
        self.k = kernels.require()
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.small_m = SMALL_M.get(weight.dtype, 8)
        if native_bf16 is None:
            native_bf16 = kernels.native_bf16_matmul()
        self.native_bf16 = native_bf16 and weight.dtype == torch.bfloat16
        self.bias16 = None if bias is None or not self.native_bf16 else bias.detach().bfloat16()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_m:
            return self.k.dense_linear_small(x, self.weight, self.bias)
        if self.weight.dtype == torch.float32:
            return F.linear(x, self.weight, self.bias)
        if self.native_bf16:
            return F.linear(x.bfloat16(), self.weight, self.bias16).float()
        return self.k.widened_linear(x, self.weight, 16, self.bias, WIDEN_PANEL)


class CpuQuantized:
    """int8 / int4 blocks, float32 activations in and out."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.k = kernels.require()
        self.data, self.bits = qweight.data, qweight.bits
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.small_m = SMALL_M_QUANT[qweight.bits]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_m:
            return self.k.quant_linear_small(x, self.data, self.bits, self.bias)
        return self.k.widened_linear(x, self.data, self.bits, self.bias, WIDEN_PANEL)


class TorchDequantized:
    """Reference for quantized layers: dequantize, then ``F.linear`` in x's dtype."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.qweight, self.bias = qweight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.qweight).to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def resolve_linear_backend(name: str, device: str, dtype: torch.dtype,
                           dims: tuple[int, ...]) -> str:
    """``auto`` -> ``cpu`` where the kernels run (CPU, float32/bfloat16, every
    input dimension a multiple of 8), else ``torch``; explicit names are checked."""
    fits = dtype in SMALL_M and all(d % 16 == 0 for d in dims)
    if name == "auto":
        return "cpu" if device == "cpu" and fits and kernels.available() else "torch"
    if name not in ("torch", "cpu"):
        raise ValueError(f"unknown linear backend {name!r}; available: auto, torch, cpu")
    if name == "cpu":
        if device != "cpu":
            raise ValueError("linear backend 'cpu' runs on the CPU only")
        if kernels.reason() is not None:
            raise ValueError(f"linear backend 'cpu' cannot run here: {kernels.reason()}")
        if not fits:
            raise ValueError("linear backend 'cpu' needs float32 or bfloat16 weights and "
                             "hidden / intermediate sizes that are multiples of 16")
    return name


# ------------------------------------------------------------------- layer ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, bit-identical
    # Computed in float32 like the reference implementation, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, and its RMSNorm: (normed, new residual)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """Reference: plain torch, activations in the model's dtype."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuOps:
    """The fused kernels; float32 activations, the residual updated in place."""

    def __init__(self) -> None:
        self.k = kernels.require()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.add_rms_norm(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up)
