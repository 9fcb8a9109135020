"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``): their
pydantic models, the fields we refuse, and the mapping to ``GenerateRequest``.

Rules:

* Types are strict (``"5"`` is not an int, ``true`` is not 1); ints are accepted
  where a number is expected. Every problem is an ``InvalidRequest`` naming the
  field, which the HTTP layer turns into a 400.
* Fields we cannot honour (``n`` > 1, ``best_of`` > 1, ``echo``, a non-empty
  ``logit_bias``, tools, structured output, ...) are refused unless they carry their
  harmless default. Other unknown fields (``user``, ``metadata``, ``store``, ...)
  are tolerated and ignored, as OpenAI clients send many of them.
* Defaults follow OpenAI: ``temperature`` 1, ``max_tokens`` 16 for completions and
  "until the context is full" for chat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.types import GenerateRequest


class InvalidRequest(ValueError):
    """A 400: ``param`` is the request field at fault (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share; the vLLM extensions are at the end."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extensions (OpenAI clients send them through ``extra_body``)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # pdserve's: deadline in seconds from arrival (as the gRPC field); past it, 504
    timeout_s: float | None = None


class CompletionRequest(_SamplingFields):
    # a text, token ids, or a batch of exactly one of either
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top-N per token (OpenAI allows 0..5, we 0..20)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20, needs logprobs


def _is(*harmless: Any) -> Callable[[Any], bool]:
    # `x in (None, 1)` would accept True (== 1): compare types too.
    return lambda value: any(value == h and type(value) is type(h) for h in harmless)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict | str) and not value)


def _text_format(value: Any) -> bool:
    return value is None or (isinstance(value, Mapping) and dict(value) == {"type": "text"})


# Field -> "its value is harmless". Anything else is refused with a 400 naming it.
_REFUSED_COMMON: dict[str, Callable[[Any], bool]] = {
    "n": _is(None, 1),
    "logit_bias": _empty,
    "guided_json": _empty,
    "guided_regex": _empty,
    "guided_choice": _empty,
    "guided_grammar": _empty,
    "structured_outputs": _empty,
    "response_format": _text_format,
}
_REFUSED_COMPLETION = {
    **_REFUSED_COMMON,
    "best_of": _is(None, 1),
    "echo": _is(None, False),
    "suffix": _empty,
}
_REFUSED_CHAT = {
    **_REFUSED_COMMON,
    "tools": _empty,
    "tool_choice": _is(None, "none", "auto"),
    "functions": _empty,
    "function_call": _is(None, "none", "auto"),
    "audio": _empty,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _empty,
    "web_search_options": _empty,
}


def _refuse_unsupported(body: Mapping[str, Any], refused: Mapping[str, Callable[[Any], bool]]
                        ) -> None:
    for name, harmless in refused.items():
        if name in body and not harmless(body[name]):
            hint = " (only n=1 is supported)" if name in ("n", "best_of") else ""
            raise InvalidRequest(f"{name}={body[name]!r} is not supported by this server{hint}",
                                 name)


def _validate(model: type[_Body], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3])
        raise InvalidRequest(f"invalid request: {detail}", param) from None


def _params(r: _SamplingFields, max_tokens: int | None, logprobs: int | None,
            aliases: Mapping[str, str]) -> SamplingParams:
    if r.stream_options is not None and not r.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true",
                             "stream_options")
    if r.timeout_s is not None and not (math.isfinite(r.timeout_s) and r.timeout_s > 0):
        raise InvalidRequest(f"timeout_s must be > 0 and finite, got {r.timeout_s}", "timeout_s")
    stop = [r.stop] if isinstance(r.stop, str) else (r.stop or [])
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    try:
        return SamplingParams(
            **extra, min_tokens=r.min_tokens, temperature=r.temperature, top_p=r.top_p,
            top_k=r.top_k, min_p=r.min_p, repetition_penalty=r.repetition_penalty,
            frequency_penalty=r.frequency_penalty, presence_penalty=r.presence_penalty,
            seed=r.seed, stop=tuple(stop), stop_token_ids=tuple(r.stop_token_ids or ()),
            ignore_eos=r.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=r.include_stop_str_in_output,
        )
    except ValueError as exc:
        # SamplingParams' messages start with the field's name.
        first = str(exc).split(" ", 1)[0]
        raise InvalidRequest(str(exc), aliases.get(first, first)) from exc


def completion_request(body: Any, request_id: str) -> tuple[CompletionRequest, GenerateRequest]:
    """A ``/v1/completions`` body -> (parsed body, router request); InvalidRequest."""
    if isinstance(body, dict):
        _refuse_unsupported(body, _REFUSED_COMPLETION)
    r: CompletionRequest = _validate(CompletionRequest, body)
    params = _params(r, r.max_tokens, r.logprobs, {})
    req = GenerateRequest(request_id, params, timeout_s=r.timeout_s)
    prompt = r.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidRequest(
                f"prompt is a batch of {len(prompt)} prompts; this server takes one prompt "
                "per request (batches and n > 1 are not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids = list(prompt)  # type: ignore[arg-type]
    return r, req


def chat_messages(r: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them; text content parts are joined."""
    out = []
    for i, m in enumerate(r.messages):
        if getattr(m, "tool_calls", None):
            raise InvalidRequest("tool calls are not supported", f"messages[{i}].tool_calls")
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise InvalidRequest(f"messages[{i}].content is required", "messages")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}]: only text parts are supported, "
                        f"got type {part.type!r}", "messages")
                texts.append(part.text)
            content = "".join(texts)
        out.append({"role": m.role, "content": content})
    return out


def chat_request(body: Any, request_id: str, prompt_len: Callable[[list[dict[str, str]]], int],
                 max_model_len: int) -> tuple[ChatCompletionRequest, GenerateRequest]:
    """A ``/v1/chat/completions`` body -> (parsed body, router request); InvalidRequest.

    ``prompt_len(messages)`` tokenizes with the chat template; it is called only
    when the client set no token limit (the default is the rest of the context).
    """
    if isinstance(body, dict):
        _refuse_unsupported(body, _REFUSED_CHAT)
    r: ChatCompletionRequest = _validate(ChatCompletionRequest, body)
    messages = chat_messages(r)
    if r.top_logprobs is not None and not r.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (r.top_logprobs or 0) if r.logprobs else None
    limit_name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    if max_tokens is None:
        try:
            n = prompt_len(messages)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "messages") from exc
        max_tokens = max(1, max_model_len - n)  # a too-long prompt gets the router's 400
    params = _params(r, max_tokens, logprobs,
                     {"max_tokens": limit_name, "logprobs": "top_logprobs"})
    return r, GenerateRequest(request_id, params, messages=messages, timeout_s=r.timeout_s)
