"""The Llama-family decoder (Llama, Mistral, Qwen2) running on the paged KV cache.

A plain model: fused QKV and gate/up projections (one matmul each), RMSNorm,
rotary embeddings, attention through the backend in ``attention.py``. It computes
logits only for the rows the sampler needs. Weights come from ``weights.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.rope import RotaryEmbedding, apply_rotary


class Linear(nn.Module):
    """y = x @ weight.T + bias, weight [out, in] as checkpoints store it.

    Two paths, one switch (``pack``): the reference ``F.linear``, and on CPU oneDNN
    with the weight re-laid out once for the CPU's blocking. Measured here (1 thread,
    the default model's matrices streamed from DRAM, milliseconds for all of them):

        rows (batch)        1     8     32    256
        F.linear fp32      71   198    179   1032
        oneDNN fp32        52    56    113    822
        oneDNN bf16        30    28     60

    MKL's small-M sgemm is the slow case the packed path removes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Switch to the oneDNN path; the plain weight is dropped (same memory)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 16)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, bit-identical to the steps below
        return F.rms_norm(x, weight.shape, weight, eps)
    # Computed in float32 like the reference implementation, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.qkv = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(self.q_size, h, bias=False)
        self.gate_up = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(rms_norm(x, self.input_norm, self.eps))
        # q and k heads side by side get one rotary pass: [T, H + KVH, D]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = attn(q, k, v, kv_layer, meta)
        x = x + self.o(o.reshape(t, self.q_size))
        gate, up = self.gate_up(rms_norm(x, self.post_attn_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        # Tied models get a copy of the embedding at load time, which the oneDNN
        # path packs for the logits matmul (the lookup keeps the plain table).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = rotary
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attn: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; kv_cache [blocks, layers, 2, block, KVH, D];
        returns float32 logits [len(logits_indices), vocab]."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.tables(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i], meta, attn)
        x = rms_norm(x[logits_indices], self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(x).float()
