"""Weight-only quantization: the two formats, quantizers from float weights, GGUF
blocks taken as they are, the plain-torch dequantize reference, and the integer
kernels' exact references (``quantized_reference``, ``w8a8_reference``).

Both formats are GGUF's own block layouts (see ``csrc/quant_gemm.cpp``), row-major,
one row of blocks per output feature, 32 weights per block::

    int8  Q8_0  34 bytes: d (fp16) | q[32] int8                       w = d * q
    int4  Q4_1  20 bytes: d, m (fp16) | 16 bytes, byte j = q[j] | q[j+16] << 4
                                                                      w = d * q + m

Quantizing a Hugging Face checkpoint: int8 is symmetric per output channel (one
``d`` per row, repeated in its blocks); int4 is asymmetric per group of 32, 64 or
128 weights (``d = (max - min) / 15``, ``m = min``, repeated in the group's blocks).
The GGUF types Q8_0, Q4_1 and Q4_0 (``m = -8 d``) map onto them without any float
detour; other types are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANTIZATIONS = ("none", "int8", "int4")  # weight-only; "w8a8" is W8Weight below
GROUP_SIZES = (32, 64, 128)
BLOCK = 32
BLOCK_BYTES = {8: 34, 4: 20}
# GGUF tensor types served natively, and what they become.
GGUF_NATIVE = {"Q8_0": 8, "Q4_1": 4, "Q4_0": 4}


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int  # 8: Q8_0 blocks, 4: Q4_1 blocks
    data: torch.Tensor  # uint8 [out_features, in_features / 32 * BLOCK_BYTES[bits]]

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1]) // BLOCK_BYTES[self.bits] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def check_quantizable(name: str, in_features: int, group_size: int) -> None:
    """ValueError unless a [*, in_features] weight can take this format."""
    if group_size not in GROUP_SIZES:  # 32 is also the int8 block
        raise ValueError(f"quantization group size must be one of {GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"{name}: input size {in_features} is not a multiple of the "
                         f"quantization group size {group_size}")


def _halves(x: torch.Tensor) -> torch.Tensor:
    """float16 values [..] -> their bytes [.., 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric, one scale per output channel (stored in every block)."""
    w = w.detach().float()
    n, k = w.shape
    d = (w.abs().amax(dim=1) / 127.0).to(torch.float16).float()  # the scale as stored
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = (w * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([
        _halves(d[:, None].expand(n, k // BLOCK)),
        q.view(torch.uint8).view(n, k // BLOCK, BLOCK),
    ], dim=2)
    return QuantizedWeight(8, blocks.reshape(n, -1).contiguous())


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Asymmetric per group: d = (max - min) / 15, m = min."""
    w = w.detach().float()
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    d = ((hi - lo) / 15.0).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = ((g - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    per_block = group_size // BLOCK
    q = q.view(n, k // BLOCK, BLOCK)
    packed = q[..., :16] | (q[..., 16:] << 4)
    d_b = d.repeat_interleave(per_block, dim=1)
    m_b = m.repeat_interleave(per_block, dim=1)
    blocks = torch.cat([_halves(d_b), _halves(m_b), packed], dim=2)
    return QuantizedWeight(4, blocks.reshape(n, -1).contiguous())


def quantize(w: torch.Tensor, kind: str, group_size: int = 32) -> QuantizedWeight:
    if kind == "int8":
        return quantize_int8(w)
    if kind == "int4":
        return quantize_int4(w, group_size)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]}, got {kind!r}")


@dataclass(frozen=True)
class W8Weight:
    """W8A8 (``csrc/w8a8.cpp``): int8 weight, one float32 scale per output channel;
    activations are quantized per row on the fly (``quantize_rows``)."""

    q: torch.Tensor  # int8 [out_features, in_features]
    scale: torch.Tensor  # float32 [out_features]


def quantize_w8(w: torch.Tensor) -> W8Weight:
    """Symmetric per output channel: scale = max|w| / 127, q = round(w / scale)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (w * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
    return W8Weight(q.contiguous(), scale.contiguous())


def w8a8_group(in_features: int) -> int:
    """Input values per activation scale in W8A8: 64, else 32, else 16 (as w8a8.cpp)."""
    for g in (64, 32, 16):
        if in_features % g == 0:
            return g
    raise ValueError(f"W8A8 needs an input size that is a multiple of 16, got {in_features}")


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer kernels' activation quantizer (``csrc/quantize.h``), per row and
    group of ``group`` values: (q as float32 integers [M, groups, G], scales [M,
    groups]), with the kernels' arithmetic (float32, round half to even)."""
    x = x.float()
    m, k = x.shape
    xg = x.reshape(m, k // group, group)
    amax = xg.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (xg * inv[..., None]).round().clamp(-127, 127), amax / 127.0


def w8a8_reference(x: torch.Tensor, w: W8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 kernels' result exactly: each group's integer sum in float64 (exact),
    then the same float32 operations in the same order."""
    n, k = w.q.shape
    g = w8a8_group(k)
    q, sx = quantize_rows(x, g)
    qw = w.q.double().reshape(n, k // g, g)
    acc = torch.zeros(x.shape[0], n)
    for i in range(k // g):
        dot = (q[:, i].double() @ qw[:, i].T).float()
        acc = acc + dot * sx[:, i, None]
    y = acc * w.scale[None, :]
    return y if bias is None else y + bias.float()


def quantized_reference(x: torch.Tensor, qw: QuantizedWeight,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """The quantized kernels' result exactly (``csrc/quant_gemm.cpp``: x quantized to
    int8 per block of 32): each block's integer sum in float64 (exact), then the same
    float32 operations in the same order."""
    q, dx = quantize_rows(x, BLOCK)  # [M, nb, 32], [M, nb]
    n, nb = qw.out_features, qw.in_features // BLOCK
    b = qw.data.view(n, nb, BLOCK_BYTES[qw.bits])
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [n, nb]
    if qw.bits == 4:
        sx = dx * q.sum(dim=-1)  # exact integer sums, one float32 product
        mn = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        qs = b[..., 4:]
        qw_ = torch.cat([qs & 0x0F, qs >> 4], dim=2).double()  # [n, nb, 32]
    else:
        qw_ = b[..., 2:].contiguous().view(torch.int8).double()
    acc = torch.zeros(x.shape[0], n)
    for i in range(nb):
        dot = (q[:, i].double() @ qw_[:, i].T).float()
        acc = acc + dot * dx[:, i, None] * d[None, :, i]
        if qw.bits == 4:
            acc = acc + mn[None, :, i] * sx[:, i, None]
    return acc if bias is None else acc + bias.float()


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The reference: float32 [out, in]."""
    n = qw.out_features
    nb = qw.in_features // BLOCK
    b = qw.data.view(n, nb, BLOCK_BYTES[qw.bits])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    if qw.bits == 8:
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).float()
    return (d * q + m).reshape(n, -1)


def from_gguf(data: np.ndarray, type_name: str, name: str) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [rows, row_bytes]) in pdserve's format."""
    if type_name not in GGUF_NATIVE:
        raise ValueError(f"GGUF tensor {name} has type {type_name}, which pdserve does not "
                         f"serve quantized (supported: {', '.join(GGUF_NATIVE)})")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: GGUF data is a read-only map
    if type_name == "Q4_0":  # d | 16 nibble bytes, w = d * (q - 8): add m = -8 d
        b = raw.view(raw.shape[0], -1, 18)
        d = b[..., 0:2].contiguous().view(torch.float16)
        m = _halves(d.float().squeeze(-1) * -8.0)
        raw = torch.cat([b[..., 0:2], m, b[..., 2:]], dim=2).reshape(raw.shape[0], -1)
    return QuantizedWeight(GGUF_NATIVE[type_name], raw.contiguous())


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """A fused matrix (q/k/v, gate/up) from its parts' rows."""
    bits = {p.bits for p in parts}
    if len(bits) != 1:
        raise ValueError("parts of a fused matrix must share one quantized format")
    return QuantizedWeight(bits.pop(), torch.cat([p.data for p in parts], dim=0).contiguous())
