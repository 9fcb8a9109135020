"""A small async client for OpenAI-compatible servers (pdserve, vLLM, SGLang).

This module owns the HTTP side of one request: building the completions / chat
completions / Responses API body, reading the Server-Sent-Events stream (chunks, or
the Responses API's typed events), and turning it into a
`RequestOutput` with the client-side timings (TTFT, inter-token gaps, end-to-end
latency) and token counts. It also lists models and fetches plain text (the
server's ``/metrics``). It never raises for a failed request: the error (HTTP
status and message, timeout, connection error) is recorded on the output, so a
load test keeps going.

Timing rules (all from one `time.perf_counter` clock, in seconds):

* ``start_time``: just before the request is sent;
* ``ttft``: until the first chunk that carries generated text;
* ``itl``: gaps between consecutive text-carrying chunks (a server that batches
  several tokens into one chunk shows one longer gap, as in vLLM's benchmark);
* ``latency``: until the stream ended (``[DONE]`` or end of body).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"
# A Responses stream's last event, its status as a chat finish_reason.
_RESPONSE_END = {"completed": "stop", "incomplete": "length"}
# Bodies of error answers are cut to this many characters in the recorded message.
_MAX_ERROR_TEXT = 200


@dataclass(frozen=True)
class Timeouts:
    """Bounds on one HTTP exchange, in seconds."""

    connect: float = 10.0  # TCP connect (+ TLS)
    read: float = 300.0  # longest silence between two bytes of a stream
    total: float = 1800.0  # one whole request, first byte sent to stream end

    def aiohttp(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.total, sock_connect=self.connect,
                                     sock_read=self.read)


@dataclass
class RequestOutput:
    """What one streamed request produced; filled by `OpenAIStreamClient.stream`."""

    success: bool = False
    generated_text: str = ""
    # Prompt tokens: the server's usage.prompt_tokens when reported (the truth for
    # the chat endpoint, whose template adds tokens), else the caller's count.
    prompt_len: int = 0
    # usage.completion_tokens when reported, else the number of text chunks.
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter seconds at send
    queue_time: float = 0.0  # waited for a --max-concurrency slot before sending
    status: int | None = None  # HTTP status, None when no answer came
    error: str = ""  # "" on success; "HTTP 429: ...", "TimeoutError: ...", ...
    finish_reason: str | None = None


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int | None,
                 ignore_eos: bool, extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body for `endpoint`: prompt as text, streaming with usage."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if endpoint.rstrip("/").endswith("/responses"):  # its stream always ends with usage
        body["input"] = prompt
        if max_tokens is not None:
            body["max_output_tokens"] = max_tokens
    else:
        body["stream_options"] = {"include_usage": True}
        if endpoint.rstrip("/").endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        # max_tokens on both endpoints: vLLM, SGLang and pdserve all accept it for chat.
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """Generated text in one streamed chunk (completions ``text``, chat ``delta``, a
    Responses ``output_text.delta`` event)."""
    if chunk.get("type") == "response.output_text.delta":
        return str(chunk.get("delta") or "")
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], Mapping):
        return ""
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        # Reasoning models stream their thinking separately; it is still output.
        for key in ("content", "reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str) and delta[key]:
                return str(delta[key])
    return ""


def chunk_end(chunk: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any] | None]:
    """(finish_reason, usage as chat's ``completion_tokens`` / ``prompt_tokens``) that
    one chunk reports, each None when it reports none."""
    if isinstance(chunk.get("type"), str):  # a Responses event: its last one says both
        response = chunk.get("response")
        if chunk["type"] != "response.completed" or not isinstance(response, Mapping):
            return None, None
        usage = response.get("usage")
        return _RESPONSE_END.get(str(response.get("status"))), (
            {"completion_tokens": usage.get("output_tokens"),
             "prompt_tokens": usage.get("input_tokens")} if isinstance(usage, Mapping) else None)
    choices = chunk.get("choices") or []
    finish = (str(choices[0]["finish_reason"]) if choices and isinstance(choices[0], Mapping)
              and choices[0].get("finish_reason") else None)
    usage = chunk.get("usage")
    return finish, usage if isinstance(usage, Mapping) else None


def chunk_error(chunk: Mapping[str, Any]) -> str | None:
    """The error a chunk reports: chat's ``error`` object, a failed response."""
    if chunk.get("type") == "response.failed":
        response = chunk.get("response")
        return _error_message(response.get("error") if isinstance(response, Mapping) else None)
    if chunk.get("type") == "error" or "error" in chunk:
        return _error_message(chunk)
    return None


def _error_message(payload: Any) -> str:
    if isinstance(payload, Mapping):
        err = payload.get("error", payload)
        if isinstance(err, Mapping):
            return str(err.get("message") or err)[:_MAX_ERROR_TEXT]
        return str(err)[:_MAX_ERROR_TEXT]
    return str(payload)[:_MAX_ERROR_TEXT]


class OpenAIStreamClient:
    """One HTTP session to one server; safe to share between concurrent requests.

    Use as ``async with OpenAIStreamClient(url) as client: ...``.
    """

    def __init__(self, base_url: str, api_key: str | None = None,
                 timeouts: Timeouts | None = None, max_connections: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or Timeouts()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections  # 0 = unbounded
        self._session: aiohttp.ClientSession | None = None
        # Model listing and /metrics are small answers: never wait a request's bound.
        self._short_timeout = aiohttp.ClientTimeout(total=min(30.0, self.timeouts.total),
                                                    sock_connect=self.timeouts.connect)

    async def __aenter__(self) -> OpenAIStreamClient:
        connector = aiohttp.TCPConnector(limit=self._max_connections,
                                         limit_per_host=self._max_connections,
                                         keepalive_timeout=60)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                              timeout=self.timeouts.aiohttp())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("OpenAIStreamClient used outside 'async with'")
        return self._session

    async def list_models(self) -> list[dict[str, Any]]:
        """``GET /v1/models`` -> its ``data`` list (raises on HTTP or network errors)."""
        async with self.session.get(f"{self.base_url}/v1/models",
                                    timeout=self._short_timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {self.base_url}/v1/models: HTTP {resp.status}: "
                                 f"{(await resp.text())[:_MAX_ERROR_TEXT]}")
            data = await resp.json(content_type=None)
        models = data.get("data") if isinstance(data, Mapping) else None
        return [m for m in models or [] if isinstance(m, dict)]

    async def get_text(self, path: str) -> str | None:
        """``GET path`` as text, or None on any failure (used for ``/metrics``)."""
        try:
            async with self.session.get(f"{self.base_url}{path}",
                                        timeout=self._short_timeout) as resp:
                return await resp.text() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None

    async def stream(self, endpoint: str, body: Mapping[str, Any],
                     prompt_len: int = 0) -> RequestOutput:
        """Send one streaming request; never raises for the request's own failure."""
        out = RequestOutput(prompt_len=prompt_len)
        out.start_time = last = time.perf_counter()
        text_parts: list[str] = []
        chunks = 0
        try:
            async with self.session.post(f"{self.base_url}{endpoint}", json=body) as resp:
                out.status = resp.status
                if resp.status != 200:
                    raw = await resp.text()
                    try:
                        msg = _error_message(json.loads(raw))
                    except ValueError:
                        msg = raw.strip()[:_MAX_ERROR_TEXT] or resp.reason or ""
                    out.error = f"HTTP {resp.status}: {msg}"
                    return out
                async for data in _sse_data(resp.content):
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, Mapping):
                        continue
                    if (error := chunk_error(chunk)) is not None:
                        out.error = f"stream error: {error}"
                        break
                    now = time.perf_counter()
                    text = chunk_text(chunk)
                    if text:
                        if chunks == 0:
                            out.ttft = now - out.start_time
                        else:
                            out.itl.append(now - last)
                        last = now
                        chunks += 1
                        text_parts.append(text)
                    finish, usage = chunk_end(chunk)
                    out.finish_reason = finish or out.finish_reason
                    if usage is not None and usage.get("completion_tokens") is not None:
                        out.usage_reported = True
                        out.output_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            out.prompt_len = int(usage["prompt_tokens"])
        except TimeoutError:
            out.error = "TimeoutError: no answer within the request timeout"
        except aiohttp.ClientResponseError as exc:
            out.error = f"HTTP {exc.status}: {exc.message}"[:_MAX_ERROR_TEXT]
        except (aiohttp.ClientError, ValueError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
        except (TypeError, KeyError, AttributeError) as exc:  # a malformed chunk
            out.error = f"bad stream chunk: {type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
        out.latency = time.perf_counter() - out.start_time
        out.generated_text = "".join(text_parts)
        if not out.usage_reported:
            out.output_tokens = chunks
        if chunks == 0:
            out.ttft = out.latency  # no text at all: the whole wait was "first token"
        out.success = not out.error
        return out


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE body (one event per data line, as OpenAI sends)."""
    async for raw in content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line or line.startswith(":"):
            continue  # keep-alive blank line or SSE comment
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


def complete(base_url: str, prompt: str, model: str | None = None, max_tokens: int = 64,
             endpoint: str = COMPLETIONS, api_key: str | None = None,
             **extra_body: Any) -> RequestOutput:
    """Blocking one-shot helper: stream one prompt, return its `RequestOutput`.

    ``model`` defaults to the first of ``/v1/models``; ``extra_body`` adds body
    fields (``temperature=0``, ``ignore_eos=True``, ...).
    """

    async def go() -> RequestOutput:
        async with OpenAIStreamClient(base_url, api_key=api_key) as client:
            name = model
            if name is None:
                models = await client.list_models()
                if not models:
                    raise ValueError(f"{base_url}/v1/models lists no model")
                name = str(models[0]["id"])
            body = request_body(endpoint, name, prompt, max_tokens, False, extra_body)
            return await client.stream(endpoint, body)

    return asyncio.run(go())
