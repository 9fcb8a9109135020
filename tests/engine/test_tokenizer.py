"""Tokenizer: configs, chat template, message validation, streaming detokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

FFFD = "\ufffd"
HARD_TEXTS = (
    "Emoji 😀🚀 👍🏽 ❤️ 🇫🇷🇯🇵 family 👨‍👩‍👧 done.",
    "中文：我们今天去公园散步，天气很好。日本語のテキスト。한국어 문장.",
    "Accents: café naïve Łódź Ærø crème brûlée, combining e\u0301 and Z\u0335.",
    "Mixed 2024年 🐍 code: print('héllo, 世界') # ✓ → ∞",
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? 😀"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model("llama-gqa"))


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    return [detok.push(i) for i in ids] + [detok.finish()]


# ----- loading ----------------------------------------------------------------------


def test_ids_from_all_config_files(tiny_model, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama-gqa"), model_dir)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = {"content": "<|im_end|>", "special": True}  # AddedToken form
    cfg["bos_token"] = "<|im_start|>"
    cfg_path.write_text(json.dumps(cfg))
    model_cfg_path = model_dir / "config.json"
    model_cfg = json.loads(model_cfg_path.read_text())
    model_cfg["eos_token_id"] = [2, 7]
    model_cfg_path.write_text(json.dumps(model_cfg))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == frozenset({0, 2, 7})
    assert tok.bos_token_id == 1


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_encode_decode_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# ----- chat template ----------------------------------------------------------------


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    text = tok.render_chat(MESSAGES[:2])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2? 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.render_chat(MESSAGES[:2], add_generation_prompt=False).endswith("assistant\n")
    ids = tok.apply_chat_template(MESSAGES[:2])
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3  # <|im_start|> matched as one special token each time


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tiny_model, tok, add_generation_prompt) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_model("llama-gqa"))
    expected = ref.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt) == expected


def _reference(model_dir: Path, messages: list[dict[str, str]], **kw: object) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=True, **kw)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5


@pytest.mark.parametrize("final", ["The answer is", "  spaced out  ", "ends with a newline\n"])
@pytest.mark.parametrize("trim", [False, True], ids=["as-is", "template-trims"])
def test_continue_final_message_matches_transformers(tiny_model, tmp_path: Path, final: str,
                                                     trim: bool) -> None:
    """The rendered chat ends inside the final message (no end of turn after it), cut
    where transformers cuts it, also for a template that strips each message."""
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama-gqa"), model_dir)
    if trim:
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        assert "message['content']" in cfg["chat_template"]
        cfg["chat_template"] = cfg["chat_template"].replace(
            "message['content']", "message['content'] | trim")
        cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(model_dir)
    chat = [*MESSAGES[:2], {"role": "assistant", "content": final}]
    ids = tok.apply_chat_template(chat, False, continue_final_message=True)
    assert ids == _reference(model_dir, chat, add_generation_prompt=False,
                             continue_final_message=True)
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        final.strip() if trim else final)


def test_template_kwargs_reach_the_template(tiny_model, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama-gqa"), model_dir)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ("{% if persona is defined %}<|im_start|>system\n{{ persona }}"
                            "<|im_end|>\n{% endif %}" + cfg["chat_template"])
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(model_dir)
    kw = {"persona": "A pirate."}
    text = tok.render_chat(MESSAGES[1:2], template_kwargs=kw)
    assert text.startswith("<|im_start|>system\nA pirate.<|im_end|>")
    assert tok.apply_chat_template(MESSAGES[1:2], template_kwargs=kw) == _reference(
        model_dir, MESSAGES[1:2], add_generation_prompt=True, **kw)
    assert not tok.render_chat(MESSAGES[1:2]).startswith("<|im_start|>system")


@pytest.mark.parametrize(("kw", "match"), [
    ({"continue_final_message": True}, "needs add_generation_prompt false"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [*MESSAGES[:2], {"role": "assistant", "content": "  "}]}, "text to continue"),
    ({"template_kwargs": {"messages": []}}, "may not set messages"),
])
def test_bad_chat_options_are_clear_errors(tok: Tokenizer, kw: dict, match: str) -> None:
    messages = kw.pop("messages", MESSAGES[:2])
    with pytest.raises(ValueError, match=match):
        tok.render_chat(messages, **kw)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] is missing 'role'"),
        ([{"role": "user"}], r"messages\[0\] is missing 'content'"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string"),
        ([{"role": "user", "content": ["a"]}], r"'content'\] must be a string, got list"),
        ([{"role": 3, "content": "x"}], r"'role'\] must be a string"),
        ([{"role": "", "content": "x"}], "empty"),
        ([{"role": "wizard", "content": "x"}], "unknown role: wizard"),
    ],
)
def test_bad_messages_are_rejected_clearly(tok: Tokenizer, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_unknown_role_passes_when_the_template_accepts_it(tok: Tokenizer) -> None:
    permissive = Tokenizer(
        tok.backend,
        eos_token_ids=[2],
        bos_token_id=None,
        chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    )
    assert permissive.render_chat([{"role": "wizard", "content": "x"}]) == "[wizard] x\n"


def test_no_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, eos_token_ids=[2], bos_token_id=None, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


# ----- streaming detokenizer --------------------------------------------------------


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_stream_of_multibyte_text_is_exact_and_clean(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The tiny BPE splits these characters across tokens, so holding back matters.
    assert any(FFFD in tok.decode([i]) for i in ids)
    deltas = _stream(tok, ids, prompt=tok.apply_chat_template(MESSAGES[:2]))
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any(FFFD in d for d in deltas)


def test_stream_skips_special_tokens_and_holds_partial_chars(tok: Tokenizer) -> None:
    ids = tok.encode("😀") + [2] + tok.encode("ok") + [0]
    deltas = _stream(tok, ids)
    assert "".join(deltas) == "😀ok" == tok.decode(ids)
    assert deltas[-1] == ""  # nothing left to flush: the stream ended on a whole character


def test_unfinished_character_is_flushed_as_replacement(tok: Tokenizer) -> None:
    lead = tok.backend.token_to_id("ð")  # byte 0xF0: first byte of a 4-byte character
    deltas = _stream(tok, tok.encode("ab") + [lead])
    assert deltas[-1] == FFFD and "".join(deltas) == "ab" + FFFD


def test_window_stays_small(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    ids = tok.encode(" ".join(HARD_TEXTS) * 20)
    peak = 0
    for i in ids:
        detok.push(i)
        peak = max(peak, detok.window_size)
    assert len(ids) > 1000 and peak <= IncrementalDetokenizer.MAX_WINDOW + 1


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 767), min_size=1, max_size=40),
    prompt=st.lists(st.integers(0, 767), max_size=6),
)
def test_stream_equals_full_decode_for_any_ids(tok: Tokenizer, ids, prompt) -> None:
    """Random ids include lone UTF-8 lead/continuation bytes and special tokens."""
    deltas = _stream(tok, ids, prompt)
    full = tok.decode(ids)
    assert "".join(deltas) == full
    # A replacement char reaches a delta only if the full text really has one there.
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)


class _TightDetokenizer(IncrementalDetokenizer):
    MAX_WINDOW = 5  # resync constantly, to exercise the restart path


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 767), min_size=1, max_size=60),
    text=st.sampled_from(HARD_TEXTS),
)
def test_window_restart_keeps_the_stream_exact(tok: Tokenizer, ids, text) -> None:
    for seq in (ids, tok.encode(text), tok.encode(text) + ids):
        detok = _TightDetokenizer(tok, [])
        deltas = [detok.push(i) for i in seq] + [detok.finish()]
        full = tok.decode(seq)
        assert "".join(deltas) == full
        if FFFD not in full:
            assert not any(FFFD in d for d in deltas)
