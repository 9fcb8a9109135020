"""The Llama-family decoder (Llama, Mistral, Qwen2) running on the paged KV cache.

A plain model: fused QKV and gate/up projections (one matmul each), RMSNorm,
rotary embeddings, attention through the backend in ``attention.py``. It computes
logits only for the rows the sampler needs. Weights come from ``weights.py``.

Tensor parallel (``engine/tp/``): a rank's model holds its shard; the O and down
projections' outputs and the embedding are all-reduced, the logits gathered.

Speed comes from outside, behind switches set once by ``use``: the linear layers'
kernels and the fused per-token ops (``linear.py``) and the attention backend.
With the ``cpu`` kernels activations are float32 whatever the weights' dtype;
with the reference they are in the model's dtype. The residual stream is carried
separately so that each residual add fuses into the RMSNorm that follows it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.engine import kernels
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.attention import AttentionBackend, AttentionMetadata, CpuPagedAttention
from pdserve.engine.model.linear import CpuOps, LayerOps, Linear, TorchOps
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.tp.collectives import TPGroup


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


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        # Tied models get a copy of the embedding at load time, so that the logits
        # matmul can use its own kernel and format (the lookup keeps the table).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = rotary
        self.requires_grad_(False)
        self.ops: LayerOps = TorchOps()
        self.act_dtype: torch.dtype | None = None  # None: the weights' dtype
        self.attn: AttentionBackend | None = None
        # Tensor parallel (engine/tp/): this rank's group and vocabulary rows [lo, hi)
        # of the full ``vocab`` (cfg.vocab_size is then the padded shard width).
        self.tp: TPGroup | None = None
        self.vocab_range = (0, cfg.vocab_size)
        # All decoder layers in one C++ call (``_fused_decoder``), or None: ``_layers``,
        # the loop in Python. Whoever wraps a layer's kernels from Python sets it to None.
        self.decoder: Any = None
        self.vocab = cfg.vocab_size

    def use(self, linear_backend: str, attn: AttentionBackend, int_family: str = "avx2",
            w8a8: bool = False) -> None:
        """Choose the kernels (after the weights are loaded); int4 and W8A8 layers run
        on ``int_family``; ``w8a8``: the decoder layers' linears multiply in int8 (the
        LM head keeps the dtype)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use(linear_backend, int_family, w8a8=w8a8 and module is not self.lm_head)
        fast = linear_backend.startswith("cpu-")
        self.ops = CpuOps() if fast else TorchOps()
        self.act_dtype = torch.float32 if fast else None
        self.attn = attn
        self.decoder = self._fused_decoder()

    def _fused_decoder(self) -> Any:
        """``_layers`` as one C++ call (csrc/decoder.cpp: the same kernels in the same
        order, the same bits) where every layer runs the C++ kernels and the model is
        not tensor parallel; else None. A single-stream
        decode step spends ~1 ms of ~5 in the loop's Python and bindings otherwise."""
        attn = self.attn
        if self.tp is not None or not isinstance(self.ops, CpuOps) or \
                not isinstance(attn, CpuPagedAttention):
            return None
        k = kernels.require()
        built = []
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for layer in layers:
            ops = [lin.cpu_op() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(op is None for op in ops):
                return None
            built.append(k.DecoderLayer(
                *ops, layer.input_norm, layer.post_attn_norm, layer.qkv.takes_bf16,
                layer.gate_up.takes_bf16, layer.down.takes_bf16))
        return k.Decoder(built, attn.cos, attn.sin, attn.h, attn.kvh, attn.scale, attn.family,
                         self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T]; kv_cache [blocks, layers, 2, KVH, block, D]; returns the
        final-normed hidden states of the token indices ``rows`` (see ``logits``)."""
        assert self.attn is not None, "call use() first"
        eps, ops = self.cfg.rms_norm_eps, self.ops
        first: DecoderLayer = self.layers[0]  # type: ignore[assignment]
        residual = self._embed(input_ids)
        # Rows bound for a layer that takes_bf16 are handed over in bfloat16, rounded as
        # that layer would round them: the same bits, half the bytes, no rounding pass.
        x = ops.rms_norm(residual, first.input_norm, eps, first.qkv.takes_bf16)
        if self.decoder is not None:
            residual = self.decoder.forward(
                x, residual, kv_cache, meta.positions, meta.slot_mapping, meta.block_table,
                meta.seq_rows, meta.query_start, meta.query_len, meta.context_len)
        else:
            residual = self._layers(x, residual, kv_cache, meta)
        return ops.rms_norm(residual[rows].contiguous(), self.norm, eps)

    def _layers(self, x: torch.Tensor, residual: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers one by one (what ``decoder`` does in one call); returns the
        residual stream after the last."""
        assert self.attn is not None
        eps, ops = self.cfg.rms_norm_eps, self.ops
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            o = self.attn(layer.qkv(x), kv_cache, i, meta)
            x, residual = ops.add_rms_norm(self._reduce(layer.o(o)), residual,
                                           layer.post_attn_norm, eps, layer.gate_up.takes_bf16)
            d = self._reduce(layer.down(layer.gate_up.silu_mul(x, ops, layer.down.takes_bf16)))
            if i + 1 < len(layers):
                x, residual = ops.add_rms_norm(d, residual, layers[i + 1].input_norm, eps,
                                               layers[i + 1].qkv.takes_bf16)
            else:
                residual = residual + d
        return residual

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [n, vocab] of hidden states from ``forward`` (tensor
        parallel: gathered to rank 0; the other ranks get None)."""
        local = self.lm_head(hidden).float()
        if self.tp is None:
            return local
        full = self.tp.gather_last(local)
        return None if full is None else full[:, : self.vocab]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            out = self.embed(input_ids)
        else:  # vocab-parallel: this rank's rows, zeros elsewhere, summed over ranks
            lo, hi = self.vocab_range
            mine = (input_ids >= lo) & (input_ids < hi)
            out = self.embed((input_ids - lo).clamp(0, self.embed.num_embeddings - 1))
            out = self._reduce(out * mine.unsqueeze(-1).to(out.dtype))
        return out.to(self.act_dtype) if self.act_dtype is not None else out

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Row-parallel partial sums -> the full result on every rank (float32 wire)."""
        if self.tp is None:
            return t
        if t.dtype == torch.float32:
            return self.tp.all_reduce(t)
        return self.tp.all_reduce(t.float()).to(t.dtype)
