"""Tiny checkpoints: valid for transformers, deterministic, and with peaked logits."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.model.tiny import PRESETS, SPECIAL_TOKENS, make_tiny
from pdserve.engine.tokenizer import Tokenizer

PROMPTS = ("Hello world, this is", "The cache holds 16 tokens", "我们今天去", "def f(x):")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_loads_in_transformers_with_every_weight(preset: str, tiny_model) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tiny_model(preset)
    cfg = AutoConfig.from_pretrained(model_dir)
    spec = PRESETS[preset]
    assert type(cfg).__name__.lower().startswith(spec.model_type)
    assert cfg.num_key_value_heads == spec.num_kv_heads
    assert cfg.head_dim == spec.head_dim
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == spec.architecture
    assert not any(info.values()), info  # no missing / unexpected / mismatched weights
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert ("lm_head.weight" in tensors) == (not spec.tie_word_embeddings)
    assert any(k.endswith("q_proj.bias") for k in tensors) == spec.attention_bias
    if preset == "llama3-rope":
        rope = json.loads((model_dir / "config.json").read_text())["rope_scaling"]
        assert rope["rope_type"] == "llama3"


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = make_tiny(tmp_path / "a", "qwen2-bias", seed=3)
    b = make_tiny(tmp_path / "b", "qwen2-bias", seed=3)
    c = make_tiny(tmp_path / "c", "qwen2-bias", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _digest(a / name) == _digest(b / name), name
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny preset"):
        make_tiny(tmp_path, "gpt-7")


def test_tokenizer_is_byte_level_bpe_with_chatml_specials(tiny_model) -> None:
    model_dir = tiny_model("llama-gqa")
    tok = Tokenizer.from_dir(model_dir)
    assert 512 <= tok.vocab_size <= 1024
    ids = [tok.backend.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == [0, 1, 2]
    assert tok.eos_token_ids == frozenset({0, 2})  # tokenizer eos + generation_config list
    text = "Any text at all round-trips: ∮ 😀 ÿ \x00 \t\n"
    assert tok.decode(tok.encode(text)) == text
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == tok.vocab_size


@pytest.mark.parametrize("preset", ["llama-gqa", "qwen2-bias"])
def test_greedy_logits_are_peaked(preset: str, tiny_model) -> None:
    """Median top1-top2 logit gap over greedy generations is comfortably > 0.05."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(preset)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(model_dir)
    gaps: list[float] = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        for scores in out.scores:
            top = scores[0].topk(2).values
            gaps.append(float(top[0] - top[1]))
    assert statistics.median(gaps) > 0.2, statistics.median(gaps)
