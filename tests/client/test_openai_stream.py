"""The streaming client against the fake server: timings, usage, chat, errors."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from pdserve.client import OpenAIStreamClient, RequestOutput, complete, request_body
from pdserve.client.openai_stream import Timeouts, chunk_text
from tests.client.fake_server import FakeServer

Make = Callable[..., FakeServer]


def _stream(url: str, endpoint: str, body: dict[str, object],
            api_key: str | None = None, timeouts: Timeouts | None = None) -> RequestOutput:
    async def go() -> RequestOutput:
        async with OpenAIStreamClient(url, api_key=api_key, timeouts=timeouts) as client:
            return await client.stream(endpoint, body, prompt_len=99)

    return asyncio.run(go())


def test_completions_stream(fake_server: Make) -> None:
    srv = fake_server(ttft_s=0.02, token_gap_s=0.005)
    body = request_body("/v1/completions", "tiny-model", " a b c", 5, True, {"temperature": 0})
    out = _stream(srv.url, "/v1/completions", body)
    assert out.success and out.error == "" and out.status == 200
    assert out.generated_text == " tok" * 5
    assert out.output_tokens == 5 and out.usage_reported
    assert out.prompt_len == 3  # the server's usage wins
    assert len(out.itl) == 4
    assert out.ttft >= 0.015
    assert out.latency >= out.ttft + sum(out.itl) - 1e-6
    assert out.finish_reason == "length"
    sent = srv.bodies[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["max_tokens"] == 5 and sent["temperature"] == 0


def test_chat_without_usage_counts_chunks(fake_server: Make) -> None:
    srv = fake_server(usage=False)
    body = request_body("/v1/chat/completions", "tiny-model", "hello there", 3, False)
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    out = _stream(srv.url, "/v1/chat/completions", body)
    assert out.success and out.output_tokens == 3
    assert not out.usage_reported and out.prompt_len == 99


def test_http_errors_and_auth(fake_server: Make) -> None:
    srv = fake_server(fail_every=1)
    out = _stream(srv.url, "/v1/completions", request_body("/v1/completions", "m", "x", 2, False))
    assert not out.success and out.status == 429
    assert out.error == "HTTP 429: server overloaded"
    keyed = fake_server(api_key="sekrit")
    body = request_body("/v1/completions", "m", "x", 2, False)
    assert _stream(keyed.url, "/v1/completions", body).error == "HTTP 401: bad key"
    assert _stream(keyed.url, "/v1/completions", body, api_key="sekrit").success
    assert keyed.headers[-1]["Authorization"] == "Bearer sekrit"


def test_connection_refused_and_timeout(fake_server: Make) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = _stream(dead, "/v1/completions", {"prompt": "x"})
    assert not out.success and out.status is None
    assert "Connect" in out.error
    slow = fake_server(ttft_s=0.8)
    out = _stream(slow.url, "/v1/completions", request_body("/v1/completions", "m", "x", 2, False),
                  timeouts=Timeouts(read=0.2, total=5))
    assert not out.success and "Timeout" in out.error


def test_complete_helper(fake_server: Make) -> None:
    srv = fake_server()
    out = complete(srv.url, "some words", max_tokens=4, temperature=0)
    assert out.success and out.output_tokens == 4
    assert srv.bodies[0]["model"] == "tiny-model" and srv.bodies[0]["temperature"] == 0


@pytest.mark.parametrize(("chunk", "text"), [
    ({"choices": [{"text": "a"}]}, "a"),
    ({"choices": [{"delta": {"role": "assistant"}}]}, ""),
    ({"choices": [{"delta": {"content": "b"}}]}, "b"),
    ({"choices": [{"delta": {"content": None, "reasoning_content": "r"}}]}, "r"),
    ({"choices": [], "usage": {"completion_tokens": 3}}, ""),
])
def test_chunk_text(chunk: dict[str, object], text: str) -> None:
    assert chunk_text(chunk) == text
