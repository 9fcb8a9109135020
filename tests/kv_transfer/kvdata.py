"""Deterministic KV contents shared by the test process and the peer hosts."""

from __future__ import annotations

import hashlib

import torch

from pdserve.kv_transfer import KVLayout


def make_kv(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """Random KV (same bits in every process for the same seed); seed < 0 -> all -1."""
    shape = layout.kv_shape(num_blocks)
    if seed < 0:
        return torch.full(shape, -1.0, dtype=layout.torch_dtype)
    gen = torch.Generator().manual_seed(seed)
    if layout.dtype == "int8":  # quantized values and the scales' bytes: any bit pattern
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return torch.randn(shape, generator=gen).to(layout.torch_dtype)


def digest(blocks: torch.Tensor) -> str:
    """Bit-exact fingerprint of some blocks (bf16 included)."""
    raw = blocks.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def expected_digest(
    layout: KVLayout, num_blocks: int, seed: int, src: list[int], layers: tuple[int, int] | None
) -> str:
    kv = make_kv(layout, num_blocks, seed)[src]
    return digest(kv if layers is None else kv[:, layers[0] : layers[1]])
