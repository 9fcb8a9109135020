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
    """y = x @ weight_t (+ bias), with the weight stored transposed, [in, out].

    Measured on this CPU class (fp32, one thread, weights streamed from DRAM as in
    decode): MKL's GEMV reads [in, out] at 14.8 GB/s against 10.1 GB/s for the
    usual [out, in] layout, so single-stream decode gets ~30% faster. Prefill
    matmuls do not care about the layout.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


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
        # Tied models get a transposed copy of the embedding at load time (the
        # lookup wants [vocab, hidden], the logits matmul [hidden, vocab]).
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
