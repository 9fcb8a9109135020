"""Engine configuration: the model's architecture (read from a Hugging Face
``config.json``) and the engine's own knobs (cache size, batching budget, role).

Both are frozen dataclasses validated once at construction; bad values raise
``ValueError`` naming the field, unknown architectures name the architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pdserve.engine import defaults
from pdserve.engine.model.kv_cache import KV_CACHE_DTYPES, row_bytes

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROLES = ("colocated", "prefill", "decode")
Role = Literal["colocated", "prefill", "decode"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as the engine needs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_dict(json.loads(cfg_path.read_text()), name=Path(path).name)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "<missing>")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {arch!r}; pdserve supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # Sliding-window attention equals full attention inside the window, so a
        # model with a window is served with its context capped to the window.
        window = cfg.get("sliding_window")
        if window and (cfg.get("use_sliding_window", arch == "MistralForCausalLM")):
            max_pos = min(max_pos, int(window))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            name=name,
        )

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes ``rope_parameters``; hub checkpoints carry
    # ``rope_theta`` + ``rope_scaling``. Accept both.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
        )
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


SPEC_METHODS = ("ngram", "suffix", "draft_model")
QUANTIZATIONS = ("none", "int8", "int4", "w8a8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``engine/spec/spec_decode.py``), vLLM's ``--speculative-config``
    keys: a proposer guesses up to ``num_speculative_tokens`` next tokens, the model
    checks them all in one step. ``ngram``: prompt lookup over the request's own prompt
    and output, matching its last ``prompt_lookup_max`` down to ``prompt_lookup_min``
    tokens. ``suffix``: the same lookup, also in the worker's last
    ``suffix_decoding_max_cached_requests`` outputs, the match measured up to
    ``suffix_decoding_max_tree_depth`` tokens and the draft ``..._max_spec_factor`` x
    as long. ``draft_model``: a smaller ``model`` (a checkpoint directory, or the
    default model's name) of the same tokenizer drafts (``engine/spec/draft_model.py``),
    its linear layers in ``quantization`` (``none``, ``int8``, ``int4``, ``w8a8``;
    unset: the target's), so the target's own int4 copy is a draft of any model.
    ``disable_by_batch_size``: no
    speculation in a step with more running requests than this (decode is no longer
    memory-bound there); unset, the method and the engine's kernel family decide
    (``spec_decode.batch_limit``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    model: str | None = None  # draft_model: the draft's checkpoint directory
    quantization: str | None = None  # draft_model: the draft's weights (unset: the target's)

    def __post_init__(self) -> None:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model (a draft checkpoint directory) goes "
                             "with method draft_model, and only with it")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError("speculative_config.quantization is the draft model's: it goes "
                             "with method draft_model")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"speculative_config.quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got "
                             f"{self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 32:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max <= 32, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        if not (1 <= self.suffix_decoding_max_tree_depth <= 256
                and self.suffix_decoding_max_cached_requests >= 0
                and self.suffix_decoding_max_spec_factor > 0):
            raise ValueError("speculative_config needs suffix_decoding_max_tree_depth in "
                             "[1, 256], suffix_decoding_max_cached_requests >= 0 and "
                             "suffix_decoding_max_spec_factor > 0")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance (one worker)."""

    role: Role = "colocated"
    # Weights, KV cache and (reference path) activations. "auto" -> bfloat16 where the
    # fast kernels run (a CPU with AVX2, or CUDA), else float32; float32 is the
    # exact-parity reference and this class's default.
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = defaults.BLOCK_SIZE
    # KV cache size: an explicit block count, or derived from ``kv_cache_bytes``.
    num_blocks: int | None = None
    kv_cache_bytes: int = defaults.KV_CACHE_BYTES
    # Tokens computed per step across all sequences (chunked prefill falls out of it).
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_model_len: int | None = None  # defaults to the model's context
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None = leave as is
    # Kernels (see attention.py / linear.py): "torch" is the plain-torch reference,
    # "cpu" pdserve's C++ kernels (built at install), "auto" the fastest that runs here.
    # linear_backend can also force one family of the C++ GEMM: "cpu-avx2" (float32
    # FMA), "cpu-avx512bf16" or "cpu-amx" (bfloat16 weights only); attention_backend
    # one of the paged attention's: "cpu-avx2" (float32), "cpu-avx512bf16" or "cpu-amx"
    # (bfloat16 cache only).
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # Weight-only quantization of the linear layers (quant.py): "none", "int8" (per
    # output channel) or "int4" (groups of quantization_group_size, with mins). The
    # KV cache keeps ``dtype``, so quantized and float workers exchange the same KV.
    # "w8a8": int8 weights (per channel) x int8 activations (dynamic, per token and
    # group of 64 inputs) for compute-bound prefill and batched decode; the LM head
    # keeps ``dtype``.
    quantization: str = "none"
    quantization_group_size: int = 32
    # Ranks one engine is split over (engine/tp/): each holds 1/N of the weights and
    # KV heads; one process per rank, one thread each (num_threads) on CPU.
    tensor_parallel_size: int = 1
    # Speculative decoding (a mapping with SpeculativeConfig's keys is accepted); None: off.
    speculative_config: SpeculativeConfig | None = None
    # The KV cache's format (kv_cache.py): "auto" keeps ``dtype``; "int8" stores each
    # token's key and value per head as int8 with a float32 scale (1.88x the tokens in
    # the same memory at head_dim 64). Both ends of a KV hand-off must agree.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", self._auto_dtype())
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype == "auto":
            object.__setattr__(self, "kv_cache_dtype", self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {tuple(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be none, int8, int4 or w8a8, got "
                             f"{self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got "
                             f"{self.quantization_group_size}")
        from pdserve.engine.kernels import DENSE_FAMILIES

        attention = ("auto", "torch", "cpu", *(f"cpu-{f}" for f in DENSE_FAMILIES))
        if self.attention_backend not in attention:
            raise ValueError(f"attention_backend must be one of {', '.join(attention)}, got "
                             f"{self.attention_backend!r}")

        linear = ("auto", "torch", "cpu", *(f"cpu-{f}" for f in DENSE_FAMILIES))
        if self.linear_backend not in linear:
            raise ValueError(f"linear_backend must be one of {', '.join(linear)}, got "
                             f"{self.linear_backend!r}")
        if self.device != "cpu" and (self.attention_backend.startswith("cpu")
                                     or self.linear_backend.startswith("cpu")):
            raise ValueError("the 'cpu' kernels run on the CPU only")

    def _auto_dtype(self) -> str:
        """bfloat16 halves the bytes a decode step reads; measured end to end on the
        CPU kernels it is 1.75x faster single-stream and as fast in prefill, with the
        default model's perplexity unchanged (+0.00%). The reference CPU path has no
        fast bfloat16 matmul on AVX2 machines: float32 there."""
        from pdserve.engine import kernels

        if self.device != "cpu":
            return "bfloat16"
        fast = self.linear_backend != "torch" and kernels.available()
        return "bfloat16" if fast else "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolve_num_blocks(self, model: ModelConfig) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = (model.num_layers * 2 * self.block_size * model.num_kv_heads
                     * row_bytes(model.head_dim, self.kv_cache_dtype))
        return max(2, self.kv_cache_bytes // per_block)

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}], got {self.max_model_len}")
        return self.max_model_len

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys: {unknown}")
        return cls(**d)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
