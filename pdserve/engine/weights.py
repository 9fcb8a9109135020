"""Loading Hugging Face safetensors checkpoints (one file or a sharded index) into
``LlamaModel``, fusing q/k/v and gate/up projections on the way in."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model import LlamaModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our parameter, index of the slice in a fused matrix)
_FUSED = {
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "mlp.gate_proj": ("gate_up", 0),
    "mlp.up_proj": ("gate_up", 1),
}
_PLAIN = {
    "self_attn.o_proj": "o",
    "mlp.down_proj": "down",
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir}"
    )


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, fh.get_tensor(name)


def load_weights(model: LlamaModel, model_dir: Path) -> None:
    """Copy every checkpoint tensor into ``model``; missing or unexpected tensors
    are errors naming them."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    splits = {"qkv": [0, q, q + kv, q + 2 * kv], "gate_up": [0, inter, 2 * inter]}
    expected = {n for n, _ in model.named_parameters()}
    loaded: set[str] = set()
    params = dict(model.named_parameters())

    def put(name: str, value: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        # A fused matrix's parts are row ranges of it.
        p = params[name]
        target = p.data if rows is None else p.data[rows[0] : rows[1]]
        if target.shape != value.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != {tuple(target.shape)}")
        target.copy_(value)
        loaded.add(name if rows is None else f"{name}#{rows[0]}")

    for hf_name, tensor in iter_tensors(model_dir):
        if hf_name == "model.embed_tokens.weight":
            put("embed.weight", tensor)
        elif hf_name == "model.norm.weight":
            put("norm", tensor)
        elif hf_name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                put("lm_head.weight", tensor)
        elif (m := _LAYER.match(hf_name)) is not None:
            layer, rest = m.group(1), m.group(2)
            module, _, kind = rest.rpartition(".")  # kind: weight | bias
            prefix = f"layers.{layer}."
            if rest == "input_layernorm.weight":
                put(prefix + "input_norm", tensor)
            elif rest == "post_attention_layernorm.weight":
                put(prefix + "post_attn_norm", tensor)
            elif module in _FUSED:
                fused, idx = _FUSED[module]
                lo, hi = splits[fused][idx], splits[fused][idx + 1]
                put(f"{prefix}{fused}.{kind}", tensor, (lo, hi))
            elif module in _PLAIN:
                put(f"{prefix}{_PLAIN[module]}.{kind}", tensor)
            elif "rotary_emb" not in rest:
                raise ValueError(f"unexpected tensor in checkpoint: {hf_name}")
        else:
            raise ValueError(f"unexpected tensor in checkpoint: {hf_name}")

    if cfg.tie_word_embeddings:
        model.lm_head.weight.data.copy_(model.embed.weight.data)
        loaded.add("lm_head.weight")
    fused_parts = {"qkv": 3, "gate_up": 2}
    missing = []
    for name in sorted(expected):
        base = name.split(".")[-2] if name.count(".") >= 2 else ""
        if base in fused_parts:
            got = sum(1 for x in loaded if x.startswith(name + "#"))
            if got != fused_parts[base]:
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors for: {missing[:8]}")
