"""Tiny random-weight Llama-family checkpoints for tests.

This module owns the tiny-model presets, the small built-in text corpus, the
offline training of the tiny byte-level BPE tokenizer and the random weight
initialisation. `make_tiny` writes a directory in Hugging Face layout
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that both transformers and pdserve load.

Presets (all: SiLU MLP, float32 weights, max_position_embeddings 2048):

| preset        | architectures       | hidden | layers | heads/kv | head_dim | inter | tied | extra                          |
|---------------|---------------------|--------|--------|----------|----------|-------|------|--------------------------------|
| `llama-gqa`   | LlamaForCausalLM    | 64     | 3      | 4/2      | 16       | 192   | yes  |                                |
| `llama-mha`   | LlamaForCausalLM    | 64     | 2      | 4/4      | 16       | 128   | no   |                                |
| `llama3-rope` | LlamaForCausalLM    | 128    | 2      | 4/2      | 32       | 320   | yes  | rope_scaling llama3, theta 5e5 |
| `qwen2-bias`  | Qwen2ForCausalLM    | 64     | 2      | 4/2      | 16       | 176   | no   | q/k/v bias, theta 1e6          |
| `mistral`     | MistralForCausalLM  | 96     | 2      | 4/1      | 32 (≠96/4)| 256  | no   | sliding_window null            |

Peaked logits: weights are drawn with a larger spread than a training init so the
greedy next token wins by a clear margin (the test measures the median top1-top2
logit gap with transformers), which keeps greedy comparisons between two
implementations robust to float rounding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Special tokens take ids 0, 1, 2 (the BPE trainer places them first), as in SmolLM2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 768

# ChatML; roles outside this list are rejected by the template itself, so
# Tokenizer.apply_chat_template's "unknown role" path has a template that refuses.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The training text: English prose and code plus accents, CJK and emoji, so that the
# learned merges include multi-byte characters and tokens that split them.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A serving system reads the prompt once "
    "and then writes one token at a time for every request that is still running.",
    "Prefill is limited by arithmetic, decode is limited by memory bandwidth. Splitting the "
    "two phases onto separate workers keeps long prompts from stalling short streams.",
    "Each block of the key value cache holds sixteen tokens. Blocks are counted, shared "
    "between requests with the same prefix, and freed when the last reader is done.",
    "def greet(name: str) -> str:\n    return f'Hello, {name}!'\n\nfor i in range(10):\n"
    "    print(greet(str(i)))\n",
    "In 2024 the team measured 1536 tokens per second at batch 64, then 3072 at batch 128.",
    "Café, naïve, résumé, façade, São Paulo, Zürich, Ærø, Łódź, crème brûlée, jalapeño.",
    "Die Straße ist schön, aber der Bäcker öffnet erst um acht Uhr. ¿Dónde está la estación?",
    "我们今天去公园散步，天气很好。机器学习模型需要大量的数据。你好，世界！",
    "日本語のテキストも少し入れておきます。東京は大きな都市です。ありがとうございます。",
    "한국어 문장도 있습니다. 안녕하세요, 반갑습니다.",
    "Emoji test: 😀 😃 🚀 🎉 👍🏽 ❤️ 🇫🇷 🐍 — done. Symbols: € £ ¥ © ® ™ ∑ ∞ ≈ ≠ ← → ✓",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n",
    "Once upon a time there was a little model that wanted to write stories. It learned "
    "words, then sentences, then whole paragraphs about rivers, mountains and the sea.",
)


@dataclass(frozen=True)
class TinyPreset:
    """Shape and family of one tiny model; every field maps to a config.json key."""

    architecture: str  # config.json "architectures"[0]
    model_type: str  # config.json "model_type"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Family-specific config.json keys written verbatim (rope_scaling, sliding_window…).
    extra: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, TinyPreset] = {
    "llama-gqa": TinyPreset("LlamaForCausalLM", "llama", 64, 3, 4, 2, 16, 192, True),
    "llama-mha": TinyPreset("LlamaForCausalLM", "llama", 64, 2, 4, 4, 16, 128, False),
    "llama3-rope": TinyPreset(
        "LlamaForCausalLM",
        "llama",
        128,
        2,
        4,
        2,
        32,
        320,
        True,
        rope_theta=500000.0,
        extra={
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "qwen2-bias": TinyPreset(
        "Qwen2ForCausalLM",
        "qwen2",
        64,
        2,
        4,
        2,
        16,
        176,
        False,
        attention_bias=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        extra={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2},
    ),
    "mistral": TinyPreset(
        "MistralForCausalLM",
        "mistral",
        96,
        2,
        4,
        1,
        32,
        256,
        False,
        extra={"sliding_window": None},
    ),
}

# Init spreads (see module docstring). Linear layers use gain / sqrt(fan_in); the
# embedding spread makes tied logits ~ EMBED_STD * sqrt(hidden) wide.
EMBED_STD = 0.4
LINEAR_GAIN = 1.4
LM_HEAD_GAIN = 3.0
NORM_JITTER = 0.1  # norm weights are 1 + jitter * N(0,1) so a loader that ignores them fails
BIAS_STD = 0.2


def train_tiny_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on CORPUS (offline, deterministic, single pass)."""
    tok = Tokenizer(BPE())
    # Same pre-tokenizer as SmolLM2 ("smollm" in GGUF): single digits, then GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so pair counts are not all ties; training is a few ms.
    tok.train_from_iterator([text for text in CORPUS for _ in range(3)], trainer=trainer)
    return tok


def _init_weights(p: TinyPreset, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def linear(out_f: int, in_f: int, gain: float = LINEAR_GAIN) -> torch.Tensor:
        return normal((out_f, in_f), gain / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + normal((n,), NORM_JITTER)

    h, q_dim, kv_dim = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    # Insertion order is fixed, so the generator draws the same numbers for a seed.
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, h), EMBED_STD)}
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm(h)
        w[pre + "self_attn.q_proj.weight"] = linear(q_dim, h)
        w[pre + "self_attn.k_proj.weight"] = linear(kv_dim, h)
        w[pre + "self_attn.v_proj.weight"] = linear(kv_dim, h)
        if p.attention_bias:
            w[pre + "self_attn.q_proj.bias"] = normal((q_dim,), BIAS_STD)
            w[pre + "self_attn.k_proj.bias"] = normal((kv_dim,), BIAS_STD)
            w[pre + "self_attn.v_proj.bias"] = normal((kv_dim,), BIAS_STD)
        w[pre + "self_attn.o_proj.weight"] = linear(h, q_dim)
        w[pre + "post_attention_layernorm.weight"] = norm(h)
        w[pre + "mlp.gate_proj.weight"] = linear(p.intermediate_size, h)
        w[pre + "mlp.up_proj.weight"] = linear(p.intermediate_size, h)
        w[pre + "mlp.down_proj.weight"] = linear(h, p.intermediate_size)
    w["model.norm.weight"] = norm(h)
    if not p.tie_word_embeddings:
        w["lm_head.weight"] = linear(vocab, h, LM_HEAD_GAIN)
    return w


def _model_config(p: TinyPreset, vocab: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "vocab_size": vocab,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": p.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if p.model_type == "llama":
        cfg.update(attention_bias=p.attention_bias, mlp_bias=False, pretraining_tp=1)
    cfg.update(p.extra)
    return cfg


def make_tiny(out_dir: str | Path, preset: str = "llama-gqa", seed: int = 0) -> Path:
    """Write a tiny random checkpoint for `preset` into `out_dir` and return its path.

    The same (preset, seed) always gives byte-identical weights and tokenizer.
    Raises ValueError for an unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tiny_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)

    save_file(
        _init_weights(p, vocab, seed), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    _write_json(out / "config.json", _model_config(p, vocab))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 0,
            # Both end markers stop generation; the tokenizer unions these with config.json's.
            "eos_token_id": [2, 0],
            "pad_token_id": 0,
        },
    )
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
