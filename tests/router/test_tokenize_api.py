"""vLLM's tokenizer endpoints (``router/openai/tokenize.py``) and ``GET /v1/models/{id}``
on the HTTP API over a real in-process router: a chat body's tokens are the ones
chat completions prefill, a prompt's the ones completions do; detokenize inverts
tokenize; lm-evaluation-harness' remote tokenizer and the openai SDK work against
them; bad bodies are 4xx naming the field."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from lm_eval.utils import RemoteTokenizer

from tests.inprocess import Pair
from tests.router.http_helpers import GREEDY, Client, serve, sse

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


async def prompt_tokens(c: Client, body: dict[str, Any]) -> int:
    r = await c.post("/v1/chat/completions", json={**GREEDY, **body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_tokenize_counts_what_the_generate_routes_prefill(
        pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    tok = pair.router.tokenizer

    async def body(c: Client) -> None:
        text = "The cat sat on the mat."
        r = (await c.post("/tokenize", json={"model": "tiny", "prompt": text})).json()
        assert r == {"count": len(tok.encode(text)), "max_model_len": 2048,
                     "tokens": tok.encode(text), "token_strs": None}
        done = (await c.post("/v1/completions", json={**GREEDY, "prompt": text,
                                                        "max_tokens": 1})).json()
        assert done["usage"]["prompt_tokens"] == r["count"]
        strs = (await c.post("/tokenize", json={"prompt": text, "return_token_strs": True})
                ).json()["token_strs"]
        assert strs == [tok.id_to_token(i) for i in r["tokens"]] and len(strs) == r["count"]

        # a chat: the tokens chat completions prefill, tools (in a system prompt) too
        counts = []
        for extra in ({}, {"tools": TOOLS}):
            r = (await c.post("/tokenize", json={"messages": CHAT, **extra})).json()
            assert r["count"] == len(r["tokens"]) == await prompt_tokens(
                c, {"messages": CHAT, **extra})
            counts.append(r["count"])
        assert counts[1] > counts[0]  # the tools were rendered
        # OpenAI's developer role is system instructions (a 400 before)
        developer = [{**CHAT[0], "role": "developer"}, CHAT[1]]
        assert (await c.post("/tokenize", json={"messages": developer})).json()["tokens"] == (
            await c.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
        assert await prompt_tokens(c, {"messages": developer}) == counts[0]
        without = (await c.post("/tokenize", json={"messages": CHAT,
                                                   "add_generation_prompt": False})).json()
        whole = (await c.post("/tokenize", json={"messages": CHAT})).json()
        assert whole["tokens"][:without["count"]] == without["tokens"]
        assert without["count"] < whole["count"]

        # detokenize inverts tokenize, special tokens included
        text = tok.render_chat(CHAT)
        ids = (await c.post("/tokenize", json={"prompt": text})).json()["tokens"]
        back = await c.post("/detokenize", json={"model": "tiny", "tokens": ids})
        assert back.status_code == 200 and back.json() == {"prompt": text}

        info = (await c.get("/tokenizer_info")).json()
        assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tok.chat_template
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast"

    serve(pair, body)


def test_bad_tokenizer_bodies_are_4xx_naming_the_field(
        pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    vocab = pair.router.tokenizer.vocab_size

    async def body(c: Client) -> None:
        for path, sent, status, param, says in [
            ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens", "outside the vocabulary"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens", "greater than or equal to 0"),
            ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "valid list"),
            ("/tokenize", {}, 400, "prompt", "Field required"),
            ("/tokenize", {"prompt": 5}, 400, "prompt", "valid string"),
            ("/tokenize", {"prompt": "x", "model": "other"}, 404, None, "not served here"),
            ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
            ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
             "role"),
            ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400,
             "chat_template", "model's own chat template"),
            ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
             "continue_final_message", "needs add_generation_prompt=false"),
            ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 400,
             "chat_template_kwargs", "may not set tools"),
            ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, 400,
             "continue_final_message", "needs add_generation_prompt=false"),
            ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400,
             "chat_template", "model's own chat template"),
            ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": ""}],
                                      "continue_final_message": True,
                                      "add_generation_prompt": False}, 400, "messages",
             "final message with text to continue"),
        ]:
            r = await c.post(path, json=sent)
            assert r.status_code == status, (path, sent, r.text)
            error = r.json()["error"]
            assert error["param"] == param and says in error["message"], (sent, error)
        r = await c.post("/tokenize", content=b"prompt=x",
                         headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        # harmless values of the refused fields are taken
        for path in ("/tokenize", "/v1/chat/completions"):
            r = await c.post(path, json={**GREEDY, "messages": CHAT, "chat_template": None,
                                         "max_tokens": 1})
            assert r.status_code == 200, r.text

    serve(pair, body)


def test_chat_template_extras(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """vLLM's chat extras on chat completions, over a model whose template reads a
    variable: ``continue_final_message`` answers with the continuation of the final
    message (the text completions give for the same tokens), and
    ``chat_template_kwargs`` and ``documents`` reach the template; ``/tokenize``
    counts the same prompts; ``echo`` leads the answer with the message it continues."""
    model = tmp_path / "copy" / "tiny"
    shutil.copytree(tiny_model("llama-gqa"), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if persona is defined %}<|im_start|>system\n{{ persona }}"
                            "{% for d in documents | default([]) %} [{{ d.title }}]{% endfor %}"
                            "<|im_end|>\n{% endif %}" + cfg["chat_template"])
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    pair = Pair(model)
    started = [*CHAT, {"role": "assistant", "content": "The answer starts"}]

    async def body(c: Client) -> None:
        for extras in ({"continue_final_message": True, "add_generation_prompt": False},
                       {"chat_template_kwargs": {"persona": "A pirate."}},
                       {"chat_template_kwargs": {"persona": "A pirate."},
                        "documents": [{"title": "Log", "text": "..."}]}):
            messages = started if "continue_final_message" in extras else CHAT
            count = (await c.post("/tokenize", json={"messages": messages, **extras})).json()
            chat = (await c.post("/v1/chat/completions", json={
                **GREEDY, "messages": messages, "max_tokens": 8, **extras})).json()
            assert chat["usage"]["prompt_tokens"] == count["count"]
            text = tok.decode(count["tokens"], skip_special_tokens=False)
            if "chat_template_kwargs" in extras:
                assert text.startswith("<|im_start|>system\nA pirate." + (
                    " [Log]<|im_end|>" if "documents" in extras else "<|im_end|>"))
                plain = (await c.post("/tokenize", json={"messages": messages})).json()
                assert plain["count"] < count["count"]
            else:
                assert text.endswith("The answer starts")  # no end of turn after it
            same = (await c.post("/v1/completions", json={
                **GREEDY, "prompt": count["tokens"], "max_tokens": 8})).json()
            assert chat["choices"][0]["message"]["content"] == same["choices"][0]["text"]
        # echo (vLLM's): the continued message leads the answer, whole and streamed
        body = {**GREEDY, "messages": started, "max_tokens": 8, "echo": True,
                "continue_final_message": True, "add_generation_prompt": False}
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        content = whole["choices"][0]["message"]["content"]
        goes_on = (await c.post("/v1/chat/completions", json={**body, "echo": False})).json()
        assert content == "The answer starts" + goes_on["choices"][0]["message"]["content"]
        events = await sse(c, "/v1/chat/completions", {**body, "stream": True})
        assert "".join(e["choices"][0]["delta"].get("content", "")
                       for e in events[:-1]) == content
        # a new turn after a user message: nothing to echo
        r = (await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": CHAT, "max_tokens": 8, "echo": True})).json()
        plain = (await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": CHAT, "max_tokens": 8})).json()
        assert r["choices"][0]["message"] == plain["choices"][0]["message"]

    tok = pair.router.tokenizer
    try:
        serve(pair, body)
    finally:
        pair.close()


def test_lm_eval_remote_tokenizer_and_the_openai_sdk(
        pair_factory: Callable[..., Pair]) -> None:
    """Real clients: lm-evaluation-harness' ``RemoteTokenizer`` (its
    ``tokenizer_backend=remote``) and ``openai``'s ``models.retrieve``."""
    pair = pair_factory()
    tok = pair.router.tokenizer

    async def body(c: Client) -> None:
        url = str(c.base_url)

        def clients() -> None:
            remote = RemoteTokenizer(f"{url}/v1/completions", timeout=30)
            text = "Paris is the capital of France."
            assert remote.encode(text) == tok.encode(text, add_special_tokens=False)
            assert remote.decode(remote.encode(text)) == text
            assert remote.eos_token_id in tok.eos_token_ids
            assert remote.apply_chat_template(CHAT) == tok.render_chat(CHAT)
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            assert sdk.models.retrieve("tiny").id == "tiny"
            try:
                sdk.models.retrieve("nope")
            except openai.NotFoundError as exc:
                assert "not served here" in str(exc)
            else:
                raise AssertionError("an unknown model was found")

        await asyncio.to_thread(clients)

    serve(pair, body)
