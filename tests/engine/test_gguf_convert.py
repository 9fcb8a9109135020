"""GGUF conversion of the default model, checked against transformers' own GGUF loader.

transformers reads the same GGUF with its own name mapping and its own reverse of
llama.cpp's q/k permutation; if ours were wrong, attention would scramble and the
logits and greedy tokens would differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, TokenType
from safetensors.torch import load_file

from pdserve.engine.model.gguf_convert import (
    DEFAULT_MODEL_NAME,
    FORMAT_VERSION,
    MARKER_FILE,
    convert_gguf,
    default_cache_dir,
    default_gguf_path,
    is_prepared,
    prepare_default_model,
    resolve_model,
    unpermute_rope,
)
from pdserve.engine.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = (
    "Hello world",
    "In 2024, 12345 apples cost $3.50!",
    "  leading spaces\n\n\ttabs and don't we'll",
    "café 我们 😀 <|im_start|>user\nhi<|im_end|>",
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One conversion per test module; reuses the user's prepared cache if present."""
    if is_prepared(default_cache_dir()):
        return default_cache_dir()
    return prepare_default_model(
        tmp_path_factory.mktemp("cache") / DEFAULT_MODEL_NAME, progress=False
    )


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return default_gguf_path()


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: each head's rows (2, d/2) -> (d/2, 2).
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(model_dir: Path, path: Path) -> None:
    """A float32 GGUF of a tiny checkpoint, laid out as llama.cpp's converter does."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w = GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok_json["model"]["vocab"]
    special = {t["id"] for t in tok_json["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(sorted(vocab, key=vocab.__getitem__))
    w.add_token_types(
        [TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(vocab))]
    )
    w.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    )
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(tok_cfg["chat_template"])
    layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        base = name.removesuffix(".weight")
        data = tensor.numpy()
        if base in top:
            gguf_name = top[base]
        else:
            _, _, idx, rest = base.split(".", 3)
            gguf_name = f"blk.{idx}.{layer[rest]}"
            if rest == "self_attn.q_proj":
                data = _llama_cpp_permute(data, cfg["num_attention_heads"])
            elif rest == "self_attn.k_proj":
                data = _llama_cpp_permute(data, cfg["num_key_value_heads"])
        w.add_tensor(gguf_name + ".weight", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("preset", ["llama-gqa", "llama-mha"])
def test_tiny_gguf_round_trip_is_exact(preset: str, tiny_model, tmp_path: Path) -> None:
    """HF -> (llama.cpp layout) GGUF -> convert_gguf gives back the same checkpoint."""
    src = tiny_model(preset)
    write_tiny_gguf(src, tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    want, got = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    src_cfg = json.loads((src / "config.json").read_text())
    out_cfg = json.loads((out / "config.json").read_text())
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rope_theta",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert out_cfg[key] == src_cfg[key], key
    src_tok, out_tok = Tokenizer.from_dir(src), Tokenizer.from_dir(out)
    for text in TEXTS:
        assert out_tok.encode(text) == src_tok.encode(text), text
    assert out_tok.apply_chat_template(CHAT) == src_tok.apply_chat_template(CHAT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]  # no temp left


def test_config_and_layout(converted: Path) -> None:
    cfg = json.loads((converted / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert is_prepared(converted) and (converted / MARKER_FILE).is_file()
    tok = Tokenizer.from_dir(converted)
    assert tok.eos_token_ids == frozenset({2}) and tok.vocab_size == 49152
    # CONTROL tokens from the GGUF are special: matched whole, skipped when decoding.
    assert tok.encode("<|im_start|>Hello<|im_end|>") == [1, 19556, 2]
    assert tok.decode([1, 19556, 2]) == "Hello"


def test_unpermute_inverts_llama_cpp_permute() -> None:
    n_head, head_dim, cols = 3, 8, 5
    hf = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf permute: (head, 2, d/2) -> (head, d/2, 2).
    gguf = hf.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(gguf, hf)
    np.testing.assert_array_equal(unpermute_rope(gguf, n_head), hf)


def test_weights_logits_and_greedy_match_transformers_gguf_loader(
    converted: Path, gguf_file: Path
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    # Reference: the loader behind from_pretrained(..., gguf_file=...), called
    # directly (from_pretrained insists on `accelerate` for GGUF files). It maps
    # names onto a weightless model and reverse-permutes q/k itself.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(ours.config)
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    ref_cfg = LlamaConfig(**{k: v for k, v in parsed["config"].items() if k != "model_type"})
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size"):
        assert getattr(ref_cfg, key) == getattr(ours.config, key), key
    ref = AutoModelForCausalLM.from_config(ref_cfg, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(
        {k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}, strict=False
    )
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ref.tie_weights()

    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert set(ours_sd) == set(ref_sd)
    for name, tensor in ours_sd.items():
        assert torch.equal(tensor, ref_sd[name]), name

    tok = Tokenizer.from_dir(converted)
    ids = tok.apply_chat_template(CHAT)
    input_ids = torch.tensor([ids])
    greedy = {"max_new_tokens": 48, "do_sample": False, "eos_token_id": None, "pad_token_id": 2}
    with torch.no_grad():
        got = ours.generate(input_ids, **greedy)[0, len(ids) :].tolist()
        want = ref.generate(input_ids, **greedy)[0, len(ids) :].tolist()
        # Logits over prompt + answer must agree at every position.
        full = torch.tensor([ids + got])
        torch.testing.assert_close(ours(full).logits, ref(full).logits, rtol=1e-4, atol=1e-4)
    assert got == want and len(got) == 48
    assert "Paris" in tok.decode(got)


def test_tokenizer_matches_transformers_gguf_tokenizer(converted: Path, gguf_file: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours = Tokenizer.from_dir(converted)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    for add_generation_prompt in (True, False):
        want = ref.apply_chat_template(
            CHAT, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if not isinstance(want, list):
            want = want["input_ids"]
        assert ours.apply_chat_template(CHAT, add_generation_prompt) == want


def test_resolve_model(tmp_path: Path, converted: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(DEFAULT_MODEL_NAME, cache_dir=converted) == converted
    assert resolve_model(None, cache_dir=converted) == converted
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model("no-such-model")


def test_half_written_cache_is_rebuilt(tmp_path: Path, gguf_file: Path, monkeypatch) -> None:
    """A directory without a current marker is never used: it is converted again."""
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert not is_prepared(out)
    calls: list[Path] = []

    def fake_convert(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
        calls.append(Path(dst))
        Path(dst, MARKER_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION}))
        return Path(dst)

    import pdserve.engine.model.gguf_convert as gc

    monkeypatch.setattr(gc, "convert_gguf", fake_convert)
    assert prepare_default_model(out) == out and calls == [out]
    assert prepare_default_model(out) == out and calls == [out]  # now prepared: reused
    prepare_default_model(out, force=True)
    assert calls == [out, out]


def test_failed_conversion_leaves_no_directory(tiny_model, tmp_path: Path, monkeypatch) -> None:
    import pdserve.engine.model.gguf_convert as gc

    write_tiny_gguf(tiny_model("llama-gqa"), tmp_path / "tiny.gguf")
    real = gc.dequantize
    seen: list[int] = []

    def failing(data, qtype):  # dies part-way, as a crash or a full disk would
        seen.append(1)
        if len(seen) > 3:
            raise OSError("disk full")
        return real(data, qtype)

    monkeypatch.setattr(gc, "dequantize", failing)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    # Neither the target nor a temporary directory is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


def test_unsupported_gguf_is_rejected(tiny_model, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_model("llama-gqa"), path)
    data = path.read_bytes().replace(b"llama", b"gpt2x", 1)  # general.architecture value
    path.write_bytes(data)
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        convert_gguf(path, tmp_path / "out", progress=False)
