"""Rotary position embeddings (non-interleaved "rotate half" layout, as in HF Llama),
with the default, linear and llama3 frequency schedules."""

from __future__ import annotations

import math

import torch

from pdserve.engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend between.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, scaled)
    return inv


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions ``[0, max_positions)``."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        inv = inverse_frequencies(rope, head_dim).to(torch.float32)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions`` shaped [T, 1, D] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotate-half RoPE."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
