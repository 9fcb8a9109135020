"""``load_model``: a checkpoint directory made into a ready ``LlamaModel`` for one
engine's config -- shapes (this rank's shard under tensor parallelism), the attention
and linear backends for the device, weights read straight into place, quantized as
configured. The engine loads its model with it, and a draft model (``draft_model.py``)
the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model.attention import make_attention, resolve_attention_backend
from pdserve.engine.model.linear import int_family, resolve_linear_backend
from pdserve.engine.model.model import LlamaModel
from pdserve.engine.model.quant_load import QuantReport, quantize_model
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.model.weights import load_weights, shard_cut
from pdserve.engine.tp.collectives import TPGroup
from pdserve.engine.tp.shard import Shard


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig  # the whole model's (a rank's shard: ``local``)
    local: ModelConfig
    max_model_len: int
    attention_backend: str
    linear_backend: str
    quant_report: QuantReport | None


def load_model(model_dir: Path, config: EngineConfig, tp: TPGroup | None = None,
               ) -> LoadedModel:
    mc = ModelConfig.from_dir(model_dir)
    max_model_len = config.resolve_max_model_len(mc)
    dtype, device = config.torch_dtype, config.device
    attention_backend = resolve_attention_backend(
        config.attention_backend, device, mc.head_dim, config.block_size, config.kv_cache_dtype)
    linear_backend = resolve_linear_backend(
        config.linear_backend, device, dtype,
        (mc.hidden_size, mc.num_heads * mc.head_dim, mc.intermediate_size))
    # The C++ attention kernel rotates in float32 whatever the model's dtype.
    rope_dtype = torch.float32 if attention_backend.startswith("cpu") else dtype
    rotary = RotaryEmbedding(mc.rope, mc.head_dim, max_model_len, rope_dtype, device)
    local = mc  # the shapes of this rank's shard (all of it without tensor parallel)
    shard = None
    if tp is not None:
        if config.quantization != "none":
            raise ValueError("tensor parallel serves unquantized weights (quantization: none)")
        shard = Shard.of(mc, tp.rank, tp.size)
        local = shard.local_config(mc)
    with torch.device("meta"):  # no throw-away random init; weights come next
        model = LlamaModel(local, rotary)
    model = model.to_empty(device=device).to(dtype)
    # A rank reads only its slices of the checkpoint, never the whole model.
    load_weights(model, model_dir, None if shard is None else shard_cut(shard, mc.head_dim))
    if tp is not None and shard is not None:
        model.tp, model.vocab_range, model.vocab = tp, shard.vocab, mc.vocab_size
        tp.use_shared_memory(config.max_num_batched_tokens * mc.hidden_size)
    quant_report = None
    if config.quantization in ("int8", "int4"):
        quant_report = quantize_model(model, model_dir, config.quantization,
                                      config.quantization_group_size)
    model.use(linear_backend, make_attention(
        attention_backend, local.num_heads, local.num_kv_heads, mc.head_dim, rotary),
        int_family(config.linear_backend), w8a8=config.quantization == "w8a8")
    return LoadedModel(model, mc, local, max_model_len, attention_backend, linear_backend,
                       quant_report)
