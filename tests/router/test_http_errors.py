"""The OpenAI HTTP API's answers to bad input and to the router's errors (a scripted
router for the error kinds that a healthy cluster does not produce on demand), and
its limits: JSON bodies only, oversize bodies, probes, no torch or Ray imported."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.api.keys import ApiKeys
from pdserve.router.api.public_errors import GENERIC
from pdserve.router.openai.response_objects import TokenText
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    RouterError,
    StreamChunk,
    Usage,
)
from tests.inprocess import Pair
from tests.router.http_helpers import GREEDY, LEAKY, Client, ScriptedRouter, serve, sse

BAD: list[tuple[str, Any, int, str | None]] = [
    # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # needs echo
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ["a"] * 65}, 400, "prompt"),  # a batch of at most 64
    ("/v1/completions", {"prompt": ["a", [5]]}, 400, "prompt"),  # texts or token ids
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),  # the router: empty prompt
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "timeout_s": 0}, 400, "timeout_s"),
    # a field no route knows: refused, naming it (chat accepted it silently before)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "foo_bar": 1},
     400, "foo_bar"),
    ("/v1/completions", {"prompt": "x", "foo_bar": 1}, 400, "foo_bar"),
    ("/tokenize", {"prompt": "x", "foo_bar": 1}, 400, "foo_bar"),
    # vLLM's extensions this server does not implement: refused, not ignored
    ("/v1/completions", {"prompt": "x", "spaces_between_special_tokens": False}, 400,
     "spaces_between_special_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/responses", {"input": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "structural_tag": "{}"}, 400, "structural_tag"),
    ("/v1/responses", {"input": "x", "logits_processors": ["a.b"]}, 400, "logits_processors"),
    # vLLM's token controls
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999]}, 400,
     "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "bad_words": [""]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["\u00e9" * 70]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 65}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("/v1/responses", {"input": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),  # the router: empty prompt
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),  # token id outside the vocabulary
    # echo decodes the prompt before the request runs (it overflowed the tokenizer: 500)
    ("/v1/completions", {"prompt": [2**63], "echo": True, "logprobs": 1, "max_tokens": 0},
     400, "prompt"),
    ("/v1/completions", {"prompt": [99999], "echo": True, "max_tokens": 1}, 400, "prompt"),
    # the model's limits (context, vocabulary) name the field as the client sent it
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}],
                              "return_token_ids": True}, 400, "messages"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 5000}, 400, "max_output_tokens"),
    ("/v1/responses", {"input": "x" * 3000}, 400, "input"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    # Lone surrogates (the tokenizer raised TypeError: 500), deep nesting (RecursionError: 500)
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}', 400,
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "\\udbff"}]}]}', 400, "messages"),
    ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', 400, None),
    ("/v1/completions", b"[" * 2000 + b"]" * 2000, 400, None),  # within the 4096-byte limit
    ("/v1/completions", b'{"prompt": "x", "user": ' + b"[" * 33 + b"]" * 33 + b"}", 400, None),
]

def test_bad_input_is_a_4xx_and_the_server_keeps_serving(
        pair_factory: Callable[..., Pair]) -> None:
    key = {"Authorization": "Bearer sesame"}

    async def body(c: Client) -> None:
        for path, payload, status, param in BAD:
            kw: dict[str, Any] = ({"content": payload} if isinstance(payload, bytes)
                                  else {"json": payload})
            r = await c.post(path, **kw, headers={**key, "Content-Type": "application/json"})
            assert r.status_code == status, (payload, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and err["param"] == param, (payload, err)
        # Which prompt of a batch the router refused.
        r = await c.post("/v1/completions", json={"prompt": ["a", "b", ""]}, headers=key)
        assert r.json()["error"]["message"] == "prompt[2]: prompt is empty", r.text
        # Brackets inside strings do not count as nesting.
        r = await c.post("/v1/completions", json={**GREEDY, "prompt": "[{" * 500, "max_tokens": 1},
                         headers=key)
        assert r.status_code == 200, r.text
        # tolerated: fields OpenAI clients send with harmless values
        r = await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "max_completion_tokens": 2, "n": 1, "user": "u", "logit_bias": {}, "store": False,
            "metadata": {"a": "b"}, "tool_choice": "none", "response_format": {"type": "text"},
            # vLLM's unimplemented extensions at their defaults, as vLLM's clients send them
            "skip_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0,
            "bad_words": [], "add_special_tokens": False, "echo": False, "cache_salt": None,
            "allowed_token_ids": None, "truncate_prompt_tokens": None,
            "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True,
            # OpenAI's fields that cannot change the answer here: accepted, logged ignored
            "reasoning_effort": "low", "service_tier": "auto", "verbosity": "low",
            "prompt_cache_key": "k", "safety_identifier": "s"},
            headers=key)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = await c.post("/v1/responses", json={**GREEDY, "input": "x", "max_output_tokens": 2,
                                                "reasoning": {"effort": "high"}}, headers=key)
        assert r.status_code == 200, r.text  # a 400 before: the Agents SDK sends it
        assert (await c.get("/nope", headers=key)).json()["error"]["message"] == "Not Found"
        r = await c.post("/v1/completions", json={"prompt": "x"}, headers={**key, "X-Request-Id": "x" * 200})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        # 413 before parsing: a declared length, and a chunked body that runs past the limit
        r = await c.post("/v1/completions", content=b" " * 5000,
                         headers={**key, "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(5):
                yield b" " * 1000

        r = await c.post("/v1/completions", content=chunks(), headers=key)
        assert r.status_code == 413
        # 401: key required everywhere (a future /admin route too) but /health and /metrics
        r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 401
        for path in ("/admin/drain", "/openapi.json", "/v1/nope"):
            assert (await c.get(path)).status_code == 401, path
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer rotated"})
                ).status_code == 200  # the second key
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        r = await c.post("/v1/completions", json={**GREEDY, "prompt": "x", "max_tokens": 2},
                         headers=key)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    serve(pair_factory(), body, api_keys=ApiKeys(["sesame", "rotated"]), max_body_bytes=4096)


def test_router_errors_map_to_status(tiny_model: Callable[[str], Path]) -> None:
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    req = {"prompt": "x"}
    expected = [(ErrorKind.INVALID, 400), (ErrorKind.OVERLOADED, 429), (ErrorKind.NOT_READY, 503),
                (ErrorKind.DEADLINE, 504), (ErrorKind.INTERNAL, 500)]

    async def body(c: Client) -> None:
        for kind, status in expected:
            router.script = [RouterError(kind, f"{kind.value}!", retry_after_s=2.0)]
            for stream in (False, True):  # before the first token: a status, even streaming
                r = await c.post("/v1/completions", json={**req, "stream": stream},
                                 headers={"X-Request-Id": "r-1"})
                shown = (f"{kind.value}!" if status != 500 else
                         "internal error (request id r-1; details are in the server log)")
                assert r.status_code == status and r.json()["error"]["message"] == shown
                assert r.headers.get("retry-after") == ("2" if status in (429, 503) else None)
                # A message with server internals in it is not shown (the log has it).
                router.script = [RouterError(kind, LEAKY, retry_after_s=2.0)]
                # (a fixed id: a made-up one, in the 500's message, may hold a "secret")
                r = await c.post("/v1/completions", json={**req, "stream": stream},
                                 headers={"X-Request-Id": "r-2"})
                assert r.json()["error"]["message"] in (GENERIC[kind], *(
                    [] if status != 500 else [r.json()["error"]["message"]]))
                for secret in ("4242", "10.1.2.3", "/opt/", "8d1a2c3b", "\x1b", "ray::"):
                    assert secret not in r.text
                router.script = [RouterError(kind, f"{kind.value}!", retry_after_s=2.0)]
        router.script = [StreamChunk([5], "a"), RouterError(ErrorKind.INTERNAL, LEAKY)]
        events = await sse(c, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "stream": True})
        assert events[1]["choices"][0]["delta"]["content"] == "a"
        assert events[2]["error"]["message"].startswith("internal error (request id ")
        assert events[3] == "[DONE]"
        router.script = [StreamChunk([5], "a"), FinalChunk("stop", Usage(1, 1), stop_reason=5)]
        r = await c.post("/v1/completions", json=req)
        assert r.json()["choices"][0]["text"] == "a"
        assert r.json()["choices"][0]["stop_reason"] == 5
        router.is_ready = False
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"

    serve(router, body)


def test_only_json_bodies_are_accepted(tiny_model: Callable[[str], Path]) -> None:
    # Before: any Content-Type was parsed as JSON, so a page on another origin could
    # POST a text/plain "simple request" (no CORS preflight) to a keyless server.
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [FinalChunk("stop", Usage(1, 0))]
    body = json.dumps({"prompt": "x"}).encode()

    async def post(c: Client, content_type: str | None) -> httpx2.Response:
        headers = {} if content_type is None else {"Content-Type": content_type}
        return await c.post("/v1/completions", content=body, headers=headers)

    async def run(c: Client) -> None:
        for refused in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                        None, "application/json; charset=latin-1", "application/jsonx"):
            r = await post(c, refused)
            assert r.status_code == 415, refused
            assert r.json()["error"]["code"] == "unsupported_media_type"
        for accepted in ("application/json", "Application/JSON; charset=UTF-8"):
            assert (await post(c, accepted)).status_code == 200, accepted

    serve(router, run)


def _raw_http(port: int, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection; the bytes read until the server closes
    it (the socket timeout only guards against a hang)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_declared_oversize_gets_413_before_the_body_is_sent(
        tiny_model: Callable[[str], Path]) -> None:
    # Before: the server read (and dropped) the body before answering, so a client
    # that declared 1 GB and waited got nothing until it gave up.
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))

    async def body(c: Client) -> None:
        port = int(str(c.base_url).rsplit(":", 1)[1].rstrip("/"))
        for expect in (b"", b"Expect: 100-continue\r\n"):
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: 1000000000\r\n" + expect + b"\r\n")
            reply = await asyncio.to_thread(_raw_http, port, head)
            assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
            assert b'"request_too_large"' in reply and b"100 Continue" not in reply

    serve(router, body, max_body_bytes=4096)


def test_protect_probes(tiny_model: Callable[[str], Path]) -> None:
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    key = {"Authorization": "Bearer k"}

    async def body(c: Client) -> None:
        for path in ("/health", "/metrics", "/v1/models"):
            assert (await c.get(path)).status_code == 401, path
            assert (await c.get(path, headers=key)).status_code == 200, path

    serve(router, body, api_keys=ApiKeys(["k"]), protect_probes=True)


def test_http_api_never_imports_torch_or_ray() -> None:
    code = ("import sys, pdserve.router.http.app; "
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "sys.exit(f'http.app imported {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_strings_carry_the_raw_bytes(tiny_model: Callable[[str], Path]) -> None:
    tok = Tokenizer.from_dir(tiny_model("llama-gqa"))
    text = TokenText(tok)
    ids = tok.encode("héllo 日本 🎉", add_special_tokens=False)
    assert b"".join(text(i)[1] for i in ids) == tok.decode(ids).encode()
    split = [text(i)[0] for i in ids if text(i)[0].startswith("bytes:")]
    assert split, "expected a token holding part of a character"
    assert all(re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", s) for s in split)
