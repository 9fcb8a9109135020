"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``): their
pydantic models, the fields we refuse, and the mapping to ``GenerateRequest``.

Rules:

* Types are strict (``"5"`` is not an int, ``true`` is not 1); ints are accepted
  where a number is expected. Every problem is an ``InvalidRequest`` naming the
  field, which the HTTP layer turns into a 400.
* Value ranges live in the models (``Field`` bounds, the same as
  ``SamplingParams``'), so the JSON schema that ``openapi_doc`` publishes states
  them; only rules between fields (``min_tokens <= max_tokens``, ``stream_options``
  needs ``stream``, ``top_logprobs`` needs ``logprobs``, ``max_tokens`` 0 needs
  ``echo``, content needed unless the role is assistant) and limits of the model
  (context, vocabulary) are not in it.
* Fields we cannot honour (``n`` > 1, ``best_of`` > 1, a non-empty
  ``logit_bias``, tools, structured output, ...) are refused unless they carry their
  harmless default; each `Refused` rule carries the JSON schema of its harmless
  values beside its test. Other unknown fields (``user``, ``metadata``,
  ``store``, ...) are tolerated and ignored, as OpenAI clients send many of them.
* Defaults follow OpenAI: ``temperature`` 1, ``max_tokens`` 16 for completions and
  "until the context is full" for chat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SamplingParams,
)
from pdserve.router.types import GenerateRequest

INT64 = 2**63
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TopN = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class InvalidRequest(ValueError):
    """A 400: ``param`` is the request field at fault (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share; the vLLM extensions are at the end."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM's extensions (OpenAI clients send them through ``extra_body``)
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    # pdserve's: deadline in seconds from arrival (as the gRPC field); past it, 504
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None


class CompletionRequest(_SamplingFields):
    # a text, token ids, or a batch of exactly one of either
    prompt: (str | list[TokenId] | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[list[TokenId]], Field(min_length=1, max_length=1)])
    logprobs: TopN | None = None  # top-N per token (OpenAI allows 0..5, we 0..20)
    # the prompt leads the output; with logprobs, its tokens' logprobs too (the first
    # token's are null), as in OpenAI's legacy API and vLLM
    echo: bool = False
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with echo (scoring)


class ContentPart(_Body):
    type: Literal["text"]  # images, audio, files: not supported
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None  # None: assistant messages only


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopN | None = None  # needs logprobs


@dataclass(frozen=True)
class Refused:
    """A field we cannot honour: allowed only with a harmless value. ``harmless``
    tests a value; ``schema`` is the JSON schema of the same values (for the
    OpenAPI document), kept beside the test so the two cannot drift apart."""

    harmless: Callable[[Any], bool]
    schema: dict[str, Any]


def _only(*values: Any) -> Refused:
    # `x in (None, 1)` would accept True (== 1): compare types too.
    return Refused(lambda v: any(v == h and type(v) is type(h) for h in values),
                   {"enum": list(values)})


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict | str) and not value)


EMPTY = Refused(_is_empty, {"anyOf": [
    {"type": "null"}, {"type": "object", "maxProperties": 0}, {"type": "array", "maxItems": 0},
    {"type": "string", "maxLength": 0}]})
TEXT_FORMAT = Refused(
    lambda v: v is None or (isinstance(v, Mapping) and dict(v) == {"type": "text"}),
    {"anyOf": [{"type": "null"}, {"type": "object", "required": ["type"],
                                  "properties": {"type": {"const": "text"}},
                                  "additionalProperties": False}]})

# Field -> its harmless values. Anything else is refused with a 400 naming it.
REFUSED_COMMON: dict[str, Refused] = {
    "n": _only(None, 1),
    "logit_bias": EMPTY,
    "guided_json": EMPTY,
    "guided_regex": EMPTY,
    "guided_choice": EMPTY,
    "guided_grammar": EMPTY,
    "structured_outputs": EMPTY,
    "response_format": TEXT_FORMAT,
}
REFUSED_COMPLETION = {
    **REFUSED_COMMON,
    "best_of": _only(None, 1),
    "suffix": EMPTY,
}
REFUSED_CHAT = {
    **REFUSED_COMMON,
    "tools": EMPTY,
    "tool_choice": _only(None, "none", "auto"),
    "functions": EMPTY,
    "function_call": _only(None, "none", "auto"),
    "audio": EMPTY,
    "modalities": Refused(lambda v: v is None or v == ["text"],
                          {"anyOf": [{"type": "null"}, {"const": ["text"]}]}),
    "prediction": EMPTY,
    "web_search_options": EMPTY,
}
# In a chat message: tool calls are not supported either.
REFUSED_MESSAGE = {"tool_calls": EMPTY}


def _refuse_unsupported(body: Mapping[str, Any], refused: Mapping[str, Refused]) -> None:
    for name, rule in refused.items():
        if name in body and not rule.harmless(body[name]):
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
            aliases: Mapping[str, str], prompt_logprobs: int | None = None) -> SamplingParams:
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
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as exc:
        # SamplingParams' messages start with the field's name.
        first = str(exc).split(" ", 1)[0]
        raise InvalidRequest(str(exc), aliases.get(first, first)) from exc


def completion_request(body: Any, request_id: str) -> tuple[CompletionRequest, GenerateRequest]:
    """A ``/v1/completions`` body -> (parsed body, router request); InvalidRequest."""
    if isinstance(body, dict):
        _refuse_unsupported(body, REFUSED_COMPLETION)
    r: CompletionRequest = _validate(CompletionRequest, body)
    if r.max_tokens == 0 and not r.echo:
        raise InvalidRequest("max_tokens must be >= 1 (0 only with echo: the prompt alone)",
                             "max_tokens")
    # echo + logprobs: the prompt's logprobs; max_tokens 0 computes them anyway
    prompt_logprobs = (r.logprobs if r.logprobs is not None else 0 if r.max_tokens == 0
                       else None) if r.echo else None
    params = _params(r, r.max_tokens, r.logprobs, {}, prompt_logprobs)
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
        extra = m.model_extra or {}
        for name, rule in REFUSED_MESSAGE.items():
            if name in extra and not rule.harmless(extra[name]):
                raise InvalidRequest(f"messages[{i}].{name} is not supported", "messages")
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise InvalidRequest(f"messages[{i}].content is required", "messages")
            content = ""
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        out.append({"role": m.role, "content": content})
    return out


def chat_request(body: Any, request_id: str, prompt_len: Callable[[list[dict[str, str]]], int],
                 max_model_len: int) -> tuple[ChatCompletionRequest, GenerateRequest]:
    """A ``/v1/chat/completions`` body -> (parsed body, router request); InvalidRequest.

    ``prompt_len(messages)`` tokenizes with the chat template; it is called only
    when the client set no token limit (the default is the rest of the context).
    """
    if isinstance(body, dict):
        _refuse_unsupported(body, REFUSED_CHAT)
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
