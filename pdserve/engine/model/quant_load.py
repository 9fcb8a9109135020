"""Putting a loaded model's linear layers into a quantized format.

Sources, per fused matrix (q/k/v, o, gate/up, down, LM head):

* the GGUF the model was prepared from (``gguf_convert.gguf_source``), when every
  part of the matrix is a GGUF type that maps onto the requested format (Q4_0 / Q4_1
  for int4, Q8_0 for int8): its blocks are taken as they are, rows reordered like
  the float conversion's (q/k un-permuted), so the served weights are exactly the
  dequantized model's;
* otherwise the float weights just loaded, quantized here.

The LM head is always int8 (per output channel, or the GGUF's Q8_0 table): measured
on the default model, int4 there costs more accuracy than its 28M weights save in
time. The input embedding stays a float lookup table (one row read per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.engine.model import quant
from pdserve.engine.model.gguf_convert import gguf_source, unpermute_rope
from pdserve.engine.model.model import Linear, LlamaModel
from pdserve.engine.model.quant import QuantizedWeight


@dataclass
class QuantReport:
    """What ``quantize_model`` did (for logs and tests)."""

    native: list[str] = field(default_factory=list)  # matrices served from GGUF blocks
    quantized: list[str] = field(default_factory=list)  # matrices quantized from floats
    weight_bytes: int = 0  # bytes of all linear weights read per step (LM head included)


def _gguf_parts(path: Path) -> dict[str, tuple[np.ndarray, str]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {t.name: (np.asarray(t.data), t.tensor_type.name) for t in reader.tensors}


def _row_order(rows: int, n_head: int) -> np.ndarray:
    """Row permutation that un-permutes a GGUF q/k matrix (see ``unpermute_rope``)."""
    return unpermute_rope(np.arange(rows).reshape(rows, 1), n_head)[:, 0]


def _native(tensors: dict[str, tuple[np.ndarray, str]], names: list[str], bits: int,
            orders: list[np.ndarray | None]) -> QuantizedWeight | None:
    parts = []
    for name, order in zip(names, orders, strict=True):
        if name not in tensors:
            return None
        data, type_name = tensors[name]
        if quant.GGUF_NATIVE.get(type_name) != bits:
            if type_name not in quant.GGUF_NATIVE and type_name not in ("F32", "F16", "BF16"):
                quant.from_gguf(data, type_name, name)  # raises, naming the type
            return None
        if order is not None:
            data = data[order]
        parts.append(quant.from_gguf(data, type_name, name))
    return quant.cat_rows(parts)


def quantize_model(model: LlamaModel, model_dir: Path, kind: str, group_size: int) -> QuantReport:
    cfg = model.cfg
    for name, module in model.named_modules():
        if isinstance(module, Linear):  # int8 (and the LM head) uses blocks of 32
            int4 = kind == "int4" and module is not model.lm_head
            quant.check_quantizable(name, module.in_features, group_size if int4 else quant.BLOCK)
    report = QuantReport()
    source = gguf_source(model_dir)
    tensors = _gguf_parts(source) if source is not None and source.is_file() else {}
    if source is not None and not tensors:
        raise FileNotFoundError(f"the GGUF {model_dir} was prepared from is gone ({source}); "
                                f"run `pdserve model prepare --force`")
    bits = 8 if kind == "int8" else 4
    q_order = _row_order(cfg.num_heads * cfg.head_dim, cfg.num_heads)
    k_order = _row_order(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)

    def put(label: str, linear: Linear, native: QuantizedWeight | None, want: str) -> None:
        if native is not None:
            report.native.append(label)
            qw = native
        else:
            report.quantized.append(label)
            qw = quant.quantize(linear.weight.data, want, group_size)
        linear.quantize(qw)
        report.weight_bytes += qw.nbytes

    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        plan: list[tuple[str, list[str], list[np.ndarray | None]]] = [
            ("qkv", [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
             [q_order, k_order, None]),
            ("o", [b + "attn_output.weight"], [None]),
            ("gate_up", [b + "ffn_gate.weight", b + "ffn_up.weight"], [None, None]),
            ("down", [b + "ffn_down.weight"], [None]),
        ]
        for attr, names, orders in plan:
            native = _native(tensors, names, bits, orders) if tensors else None
            put(f"layers.{i}.{attr}", getattr(layer, attr), native, kind)
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    native = _native(tensors, [head], 8, [None]) if tensors else None
    put("lm_head", model.lm_head, native, "int8")
    return report
