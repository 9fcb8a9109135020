"""The KV cache's element formats (``EngineConfig.kv_cache_dtype``).

A worker's KV cache is one block-major tensor (attention.py)::

    kv_cache[block, layer, 0 = K | 1 = V, kv head, slot, row]

In ``float32`` / ``bfloat16`` / ``float16`` a row is the ``head_dim`` values of one
token's key (or value) for one head. In ``int8`` it is those values quantized
symmetrically, followed by the row's float32 scale in 4 more bytes::

    row = q[0] .. q[D-1] (int8) | scale (float32 bits)      x = q * scale

    scale = max|x| / 127,  q = round_half_even(x * (127 / max|x|))   (q = 0 when x = 0)

One scale per token and head, written once with the token and never requantized
(a block fills one decode step at a time), stored beside its values, so a block is
still one contiguous region with everything needed to read it: the KV channels move
it as bytes, and prefix caching shares it as it is. 68 bytes per row for the default
model's head_dim 64 against 128 in bfloat16: 1.88x the tokens in the same memory.
The C++ kernels (``csrc/kv_rows.h``) write and read the very same bytes as the torch
reference below.
"""

from __future__ import annotations

import torch

from pdserve.kv_layout import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "new_kv_cache", "row_bytes", "row_width"]
_SCALE_BYTES = KV_CACHE_DTYPES["int8"][1]  # the float32 scale ending an int8 row


def row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements of one cache row (the tensor's last dimension)."""
    return head_dim + KV_CACHE_DTYPES[kv_dtype][1]


def new_kv_cache(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int,
                 head_dim: int, kv_dtype: str, device: str) -> torch.Tensor:
    """A zeroed block-major cache: one block of every layer is one contiguous region,
    so a transfer channel moves a request with one descriptor per block."""
    return torch.zeros(num_blocks, num_layers, 2, num_kv_heads, block_size,
                       row_width(head_dim, kv_dtype), dtype=KV_CACHE_DTYPES[kv_dtype][0],
                       device=device)


def row_bytes(head_dim: int, kv_dtype: str) -> int:
    dtype, extra = KV_CACHE_DTYPES[kv_dtype]
    return head_dim * torch.empty((), dtype=dtype).element_size() + extra


def is_quantized(kv: torch.Tensor) -> bool:
    return kv.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """float rows [..., D] -> int8 cache rows [..., D + 4] (values, then the scale)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # a true division, as the kernel's: torch computes ``127.0 / amax`` as a reciprocal
    # times 127, an ulp off in a quarter of rows (and then a value a step off)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # the float32's 4 bytes
    return torch.cat([q, scale], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., D + 4] -> float32 [..., D]."""
    d = rows.shape[-1] - _SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :d].float() * scale


def to_rows(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Float rows [..., D] in ``cache``'s format (quantized for an int8 cache)."""
    return quantize_rows(x) if is_quantized(cache) else x.to(cache.dtype)


def read_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype`` values [..., head_dim]."""
    return dequantize_rows(rows).to(dtype) if is_quantized(rows) else rows.to(dtype)
