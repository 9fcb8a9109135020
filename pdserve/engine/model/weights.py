"""Loading Hugging Face safetensors checkpoints (one file or a sharded index) into
``LlamaModel``, fusing q/k/v and gate/up projections on the way in.

Tensor parallelism (``shard_cut``): each rank reads only its slices of the file
(safetensors ``get_slice``), never the whole model. The fused projections are the
column-parallel ones (a rank's rows: its heads, its MLP columns), the plain ones the
row-parallel ones (its columns; their bias is added once, by rank 0); the embedding
and LM head are cut by vocabulary rows, padded to equal shards with zeros."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors import safe_open

from pdserve.engine.model.model import LlamaModel

if TYPE_CHECKING:
    from pdserve.engine.tp.shard import Shard

# What of a checkpoint tensor a rank reads: all (None), an index, or zeros of its shape.
Index = tuple[slice, ...] | None | Literal["zero"]
Cut = Callable[[str], Index]
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")

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


def iter_tensors(model_dir: Path, cut: Cut | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor (with ``cut``: only what it selects of each)."""
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                index = cut(name) if cut is not None else None
                if index is None:
                    yield name, fh.get_tensor(name)
                elif index == "zero":
                    view = fh.get_slice(name)
                    yield name, torch.zeros(view.get_shape(), dtype=view[:1].dtype)
                else:
                    yield name, fh.get_slice(name)[index]


def shard_cut(shard: Shard, head_dim: int) -> Cut:
    """What rank ``shard`` reads of each checkpoint tensor (see the module docstring)."""
    q = slice(shard.q_heads[0] * head_dim, shard.q_heads[1] * head_dim)
    kv = slice(shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
    inter = slice(*shard.inter)
    part = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": inter, "mlp.up_proj": inter, "self_attn.o_proj": q,
            "mlp.down_proj": inter}
    vocab = (slice(*shard.vocab),)

    def cut(name: str) -> Index:
        if name in VOCAB_ROWS:
            return vocab
        m = _LAYER.match(name)
        module, _, kind = m.group(2).rpartition(".") if m else ("", "", "")
        if module in _FUSED:  # column-parallel: rows, of the weight and of the bias
            return (part[module],)
        if module in _PLAIN:  # row-parallel: columns; the bias once, on rank 0
            if kind == "weight":
                return (slice(None), part[module])
            return None if shard.rank == 0 else "zero"
        return None  # norms: every rank has them whole

    return cut


def load_weights(model: LlamaModel, model_dir: Path, cut: Cut | None = None) -> None:
    """Copy every checkpoint tensor into ``model`` (with ``cut``: a rank's shard into a
    model built with its ``Shard.local_config``); missing or unexpected tensors are
    errors naming them."""
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
        if cut is not None and name in ("embed.weight", "lm_head.weight"):
            target.zero_()  # a vocabulary shard is padded: the last may be short
            target = target[: value.shape[0]]
        if target.shape != value.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != {tuple(target.shape)}")
        target.copy_(value)
        loaded.add(name if rows is None else f"{name}#{rows[0]}")

    for hf_name, tensor in iter_tensors(model_dir, cut):
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
