"""Linear layers and the per-token ops around them, behind one backend switch.

``Linear`` holds its weight as the checkpoint gives it (``[out, in]``) and runs
through a kernel chosen once at load (``Linear.use``):

* ``torch`` -- ``F.linear`` in the model's dtype: the reference.
* ``cpu-<family>`` -- pdserve's C++ GEMM (``csrc/gemm.cpp``) on float32 activations,
  one kernel for every batch size, from a weight packed at load for the family:

  - ``avx2``: AVX2 + FMA, float32 or bfloat16 weights, float32 arithmetic.
  - ``avx512bf16``: AVX512-BF16 ``vdpbf16ps``, bfloat16 weights, activations
    rounded to bfloat16 (2x the multiply-adds per instruction).
  - ``amx``: AMX-BF16 ``tdpbf16ps`` on the tile unit (``csrc/amx.cpp``), the same
    packing and rounding of x as ``avx512bf16``, its own rounding inside a step.

  Each output element is summed over K in one fixed order whatever the batch, so
  a row's result does not depend on the rows beside it (batch invariance by
  construction; see gemm.cpp). ``cpu`` picks the fastest family this CPU runs.

A quantized layer (``Linear.quantize``, formats in ``quant.py``) keeps only its
blocks. The integer kernels come in three families with the same results bit for
bit (``kernels.INT_FAMILIES``: ``avx2``, ``avx512vnni`` with vpdpbusd, ``amx`` with the
AMX-INT8 tiles), chosen by ``int_family``:

* int8 / int4 (``csrc/quant_gemm.cpp``): Q8_0 / Q4_1 weights repacked at load x
  activations quantized to int8 per row and block of 32; equal to
  ``quant.quantized_reference`` bit for bit. ``amx`` runs these on avx512vnni's
  kernel (``blocks_family``).
* W8A8 (``Linear.use(..., w8a8=True)``, ``csrc/w8a8.cpp``): int8 weights per channel
  x activations quantized to int8 per row and group of 64; equal to
  ``quant.w8a8_reference`` bit for bit.

``LayerOps`` is the matching switch for RMSNorm (with the residual add fused) and
SiLU-and-multiply: ``TorchOps`` is the reference, ``CpuOps`` the fused kernels.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import kernels
from pdserve.engine.model.quant import (
    QuantizedWeight,
    W8Weight,
    quantize_w8,
    quantized_reference,
    w8a8_group,
    w8a8_reference,
)

_AVX512_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
_FAMILY_FLAGS = {"avx2": {"avx2", "fma"}, "avx512bf16": _AVX512_BF16,
                 "amx": _AVX512_BF16 | {"amx_tile", "amx_bf16"}}
_BF16_ONLY = ("avx512bf16", "amx")
_VNNI = {"avx512f", "avx512bw", "avx512_vnni"}
_INT_FLAGS = {"avx2": {"avx2"}, "avx512vnni": _VNNI, "amx": _VNNI | {"amx_tile", "amx_int8"}}


def int_families() -> list[str]:
    """The integer families this CPU runs, fastest last."""
    k = kernels.load()
    flags = kernels.cpu_flags()
    return [f for f in kernels.INT_FAMILIES if _INT_FLAGS[f] <= flags
            and (f != "amx" or (k is not None and k.amx_ready()))]


def int_family(backend: str) -> str:
    """The integer (int4, int8, W8A8) family for a configured ``linear_backend``: the
    fastest this CPU runs, unless the configuration forces a dense family of a lower
    level (``cpu-avx2``: avx2, ``cpu-avx512bf16``: avx512vnni). The dense family a
    float32 model resolves to does not matter: these sums are integers."""
    families = int_families() or ["avx2"]
    if backend == "cpu-avx2":
        return "avx2"
    if backend == "cpu-avx512bf16" and "amx" in families:
        return "avx512vnni"
    return families[-1]


def blocks_family(family: str) -> str:
    """The family whose kernel multiplies int8 / int4 blocks (quant_gemm.cpp) for an
    integer family: amx's is avx512vnni's (a float scale per block of 32 of K for x
    and for W would leave a tile a 32-deep step between two float epilogues)."""
    return "avx512vnni" if family == "amx" else family


def cpu_families(dtype: torch.dtype) -> list[str]:
    """The GEMM families this CPU runs for weights of ``dtype``, fastest last."""
    k = kernels.load()
    if k is None:
        return []
    flags = kernels.cpu_flags()
    return [f for f in kernels.DENSE_FAMILIES if _FAMILY_FLAGS[f] <= flags
            and (f not in _BF16_ONLY or dtype == torch.bfloat16)
            and (f != "amx" or k.amx_ready())]  # Linux grants the tile state on request


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class SiluMulKernel(Protocol):
    def __call__(self, x: torch.Tensor, bf16_out: bool) -> torch.Tensor: ...


class Linear(nn.Module):
    """y = x @ weight.T + bias, weight [out, in] as checkpoints store it."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)
        self.kernel: LinearKernel | None = None  # None: the reference F.linear
        # silu(gate) * up of this (fused gate/up) layer's output in one kernel, where
        # its kernel family fuses it (CpuDense.silu_mul); else None (see silu_mul)
        self.fused_silu_mul: SiluMulKernel | None = None
        # whether the kernel rounds its input to bfloat16 itself (the avx512bf16 and amx
        # families): a producer may hand it bfloat16 rows, rounded as the kernel would
        # (to_bf16), the same bits at half the bytes
        self.takes_bf16 = False
        self.qweight: QuantizedWeight | None = None

    def quantize(self, qweight: QuantizedWeight) -> None:
        """Serve this layer from ``qweight``; the float weight is dropped."""
        if (qweight.out_features, qweight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight is {qweight.out_features}x{qweight.in_features}, "
                             f"the layer {self.out_features}x{self.in_features}")
        self.qweight = qweight
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def use(self, backend: str, int_family: str = "avx2", w8a8: bool = False) -> None:
        """Pick the kernel (``torch`` or ``cpu-<family>``; int4 and ``w8a8`` (int8
        weights and activations) layers run on ``int_family``, ``kernels.INT_FAMILIES``);
        called once after loading. The C++ paths keep only their own copy of the
        weight."""
        cpu = backend.startswith("cpu-")
        self.fused_silu_mul = None
        self.takes_bf16 = False
        if self.qweight is not None:
            self.kernel = (CpuQuantized(self.qweight, self.bias, int_family) if cpu
                           else TorchQuantized(self.qweight, self.bias))
            self.qweight = None  # the kernel holds what it needs
            return
        if w8a8:
            w8 = quantize_w8(self.weight.data)
            if cpu:
                w8k = CpuW8A8(w8, self.bias, int_family)
                self.kernel = w8k
                self.fused_silu_mul = w8k.silu_mul if w8k.fuses_silu_mul else None
            else:
                self.kernel = TorchW8A8(w8, self.bias)
        elif cpu:
            dense = CpuDense(self.weight.data, self.bias, backend.removeprefix("cpu-"))
            self.kernel = dense
            self.fused_silu_mul = dense.silu_mul if dense.fuses_silu_mul else None
            self.takes_bf16 = dense.rounds_x
        else:
            self.kernel = None
            return
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor, ops: LayerOps, bf16_out: bool = False) -> torch.Tensor:
        """``ops.silu_mul`` of this gate/up projection's output ([gate | up]): in the
        GEMM's epilogue where the kernel family fuses it, the same bits either way;
        ``bf16_out``: in bfloat16 where the fused epilogue can (for a layer that
        ``takes_bf16``), else float32."""
        if self.fused_silu_mul is not None:
            return self.fused_silu_mul(x, bf16_out)
        return ops.silu_mul(self(x))

    # Called ~120 times per decode step: skip nn.Module's hook machinery (~2 us a call).
    __call__ = forward

    def cpu_op(self) -> Any | None:
        """This layer's kernel as csrc/decoder.h's ``LinearOp`` (with whether it writes
        silu(gate) * up itself), or None where it is not one of the C++ kernels."""
        if not isinstance(self.kernel, (CpuDense, CpuQuantized, CpuW8A8)):
            return None
        return self.kernel.op(self.fused_silu_mul is not None)


class CpuDense:
    """Dense float32 / bfloat16 weight packed for one kernel family (``kernels.DENSE_FAMILIES``);
    float32 activations in and out, every batch size through the same kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, family: str) -> None:
        self.k = kernels.require()
        self.family = kernels.family_id(family)
        self.out_features = weight.shape[0]
        self.packed = self.k.pack_weight(weight.contiguous(), self.family)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.gemm(x, self.packed, self.out_features, self.family, self.bias)

    def op(self, fuses_silu_mul: bool) -> Any:
        """This kernel as csrc/decoder.h's ``LinearOp`` (the same call)."""
        return self.k.LinearOp(self.k.LINEAR_DENSE, self.packed, self.out_features, self.family,
                               self.bias, fuses_silu_mul=fuses_silu_mul)

    @property
    def rounds_x(self) -> bool:
        """The avx512bf16 and amx families round x to bfloat16 first (so take it in
        bfloat16 too)."""
        return self.family != kernels.family_id("avx2")

    @property
    def fuses_silu_mul(self) -> bool:
        """The avx512bf16 and amx families write silu(gate) * up themselves
        (csrc/gemm.cpp, csrc/amx.cpp), for gates and ups of whole 64-output groups."""
        return self.rounds_x and self.out_features % 128 == 0

    def silu_mul(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """silu(gate) * up of this gate/up layer's [gate | up] output, [M, out / 2]
        (bf16_out: rounded to bfloat16 as ``to_bf16`` rounds)."""
        return self.k.gemm_silu_mul(x, self.packed, self.out_features, self.family, self.bias,
                                    bf16_out)


class CpuQuantized:
    """int8 Q8_0 / int4 Q4_1 blocks repacked for an integer family
    (``csrc/quant_gemm.cpp``), float32 activations in and out, every batch size through
    the same kernel; ``quant.quantized_reference`` is its result exactly."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None, family: str) -> None:
        self.k = kernels.require()
        self.family, self.bits = kernels.family_id(blocks_family(family)), qweight.bits
        self.out_features = qweight.out_features
        self.packed = self.k.pack_quantized(qweight.data, self.bits, self.family)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.quant_gemm(x, self.packed, self.out_features, self.bits, self.family,
                                 self.bias)

    def op(self, fuses_silu_mul: bool) -> Any:
        """This kernel as csrc/decoder.h's ``LinearOp`` (the same call)."""
        assert not fuses_silu_mul, "the integer families do not fuse silu_mul"
        return self.k.LinearOp(self.k.LINEAR_QUANTIZED, self.packed, self.out_features,
                               self.family, self.bias, bits=self.bits)


class CpuW8A8:
    """int8 weight x int8 activations (scales per row and group), float32 in and out."""

    def __init__(self, w8: W8Weight, bias: torch.Tensor | None, family: str) -> None:
        self.k = kernels.require()
        self.family = kernels.family_id(family)
        self.packed = self.k.pack_w8(w8.q, self.family)
        self.scale = w8.scale
        n, k = w8.q.shape
        g = w8a8_group(k)  # colsum[group][n]: the u8 offset's correction (VNNI)
        self.colsum = w8.q.reshape(n, k // g, g).sum(dim=2, dtype=torch.int32).T.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.w8a8_gemm(x, self.packed, self.scale, self.colsum, self.family, self.bias)

    def op(self, fuses_silu_mul: bool) -> Any:
        """This kernel as csrc/decoder.h's ``LinearOp`` (the same call)."""
        return self.k.LinearOp(self.k.LINEAR_W8A8, self.packed, self.scale.numel(), self.family,
                               self.bias, scale=self.scale, colsum=self.colsum,
                               fuses_silu_mul=fuses_silu_mul)

    @property
    def fuses_silu_mul(self) -> bool:
        """The amx family writes silu(gate) * up itself (csrc/amx.cpp), for gates and
        ups of whole 64-output groups."""
        return self.family == kernels.family_id("amx") and self.scale.numel() % 128 == 0

    def silu_mul(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """silu(gate) * up of this gate/up layer's [gate | up] output, [M, out / 2],
        float32 (``bf16_out`` is for the bf16 families; W8A8's next layer quantizes
        float32)."""
        return self.k.w8a8_gemm_silu_mul(x, self.packed, self.scale, self.colsum, self.family,
                                         self.bias)


class TorchW8A8:
    """Reference for W8A8 layers (``quant.w8a8_reference``), back in x's dtype."""

    def __init__(self, w8: W8Weight, bias: torch.Tensor | None) -> None:
        self.w8, self.bias = w8, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_reference(x.reshape(-1, x.shape[-1]), self.w8, self.bias).to(x.dtype)


class TorchQuantized:
    """Reference for quantized layers (``quant.quantized_reference``), in x's dtype."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.qweight, self.bias = qweight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_reference(x.reshape(-1, x.shape[-1]), self.qweight, self.bias).to(x.dtype)


def resolve_linear_backend(name: str, device: str, dtype: torch.dtype,
                           dims: tuple[int, ...]) -> str:
    """``auto`` -> ``cpu`` where the kernels run (CPU, float32/bfloat16, every input
    dimension a multiple of 16), else ``torch``; ``cpu`` -> ``cpu-<family>``, the
    fastest family this CPU runs for ``dtype``; explicit names are checked."""
    names = ["auto", "torch", "cpu", *(f"cpu-{f}" for f in kernels.DENSE_FAMILIES)]
    if name not in names:
        raise ValueError(f"unknown linear backend {name!r}; available: {', '.join(names)}")
    fits = dtype in (torch.float32, torch.bfloat16) and all(d % 16 == 0 for d in dims)
    return kernels.resolve_backend(
        "linear", name, device, fits,
        "float32 or bfloat16 weights and hidden / intermediate sizes that are multiples of 16",
        lambda: cpu_families(dtype),
        lambda: f"for {dtype} weights this CPU runs "
                f"{', '.join('cpu-' + f for f in cpu_families(dtype))}")



# ------------------------------------------------------------------- layer ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, bit-identical
    # Computed in float32 like the reference implementation, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LayerOps(Protocol):
    """The decoder layer's pointwise ops. ``bf16_out``: the normed rows go to a layer
    that ``takes_bf16``; an implementation may return them rounded to bfloat16."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 bf16_out: bool = False) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, bf16_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, and its RMSNorm: (normed, new residual)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """Reference: plain torch, activations in the model's dtype."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 bf16_out: bool = False) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, bf16_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuOps:
    """The fused kernels; float32 activations (a norm's output in bfloat16 on request),
    the residual updated in place."""

    def __init__(self) -> None:
        self.k = kernels.require()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 bf16_out: bool = False) -> torch.Tensor:
        return self.k.rms_norm(x, weight, eps, bf16_out)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, bf16_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.add_rms_norm(x, residual, weight, eps, bf16_out), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up)
