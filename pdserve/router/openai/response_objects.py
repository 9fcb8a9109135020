"""The parts of OpenAI's response objects: ``usage``, logprobs in OpenAI's two shapes
(and vLLM's prompt logprobs), token strings, the error object with its HTTP status.
Whole responses and stream chunks are built by ``response_builder`` and each
endpoint's builder (``completion_response``, ``chat_response``).

Token strings: a token's text is its raw bytes decoded as UTF-8 when they are
valid; a token holding part of a character (byte-level BPE splits them) is written
``bytes:\\xNN...`` as OpenAI's legacy completions do, and chat's ``bytes`` field
carries the raw bytes either way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.router.api.public_errors import public_message
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    RouterError,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer

# ErrorKind -> (HTTP status, OpenAI error type, code)
ERROR_STATUS = {
    ErrorKind.INVALID: (400, "invalid_request_error", None),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.NOT_READY: (503, "service_unavailable_error", "not_ready"),
    ErrorKind.DEADLINE: (504, "timeout_error", "deadline_exceeded"),
    ErrorKind.INTERNAL: (500, "server_error", None),
}


def error_object(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def router_error_object(exc: RouterError, request_id: str,
                        param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, error object) of a router error, its message as
    ``api.public_errors`` lets the client see it; ``param``: the field at fault, as the
    client named it."""
    status, type_, code = ERROR_STATUS[exc.kind]
    return status, error_object(public_message(exc.kind, exc.message, request_id), type_, param,
                                code)


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the other
    # 68 bytes are mapped to the code points from 256 up, in byte order.
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table


_BYTE_DECODER = _byte_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


class TokenText:
    """Token id -> (OpenAI token string, raw bytes), cached per tokenizer. ``as_ids``
    (vLLM's ``return_tokens_as_token_ids``): the string is ``token_id:{id}``, which
    any token, even one that is part of a character, can be read back from."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False,
                 cache: dict[int, tuple[str, bytes]] | None = None):
        self._tok = tokenizer
        self._as_ids = as_ids
        self._cache: dict[int, tuple[str, bytes]] = {} if cache is None else cache

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        text, raw = self._entry(token_id)
        return (f"token_id:{token_id}" if self._as_ids else text), raw

    def decoded(self, token_id: int) -> str:
        """The token's text, whether or not this writes tokens as ids."""
        return self._entry(token_id)[0]

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def as_ids(self) -> TokenText:
        """The same tokens written as ids (the cache shared)."""
        return TokenText(self._tok, True, self._cache)

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            raw = bytes([int(m[1], 16)])
        elif piece and all(c in _BYTE_DECODER for c in piece):
            raw = bytes(_BYTE_DECODER[c] for c in piece)
        else:  # not a byte-level vocabulary: the decoded text is the best we know
            return text, text.encode()
        try:
            return raw.decode(), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def usage_object(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.prediction_tokens is not None:
        accepted, rejected = usage.prediction_tokens
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": rejected}
    return out


def _finite(logprob: float) -> float:
    # JSON has no -inf: a token the model gives probability 0 reads -9999, as in vLLM.
    return max(logprob, -9999.0)


def text_length(lps: list[TokenLogprob], text: TokenText) -> int:
    """Characters these tokens add to the output; bytes of a split character count 0."""
    return sum(len(text(lp.token_id)[1].decode("utf-8", "ignore")) for lp in lps)


def completion_logprobs(lps: list[TokenLogprob], text: TokenText, offset: int) -> dict[str, Any]:
    """Legacy completions shape; ``offset``: characters of output before these tokens.
    The sampled token is always in its ``top_logprobs`` entry (OpenAI: up to N + 1)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for lp in lps:
        token = text(lp.token_id)[0]
        top = {text(t)[0]: _finite(v) for t, v in lp.top}
        top.setdefault(token, _finite(lp.logprob))
        out["tokens"].append(token)
        out["token_logprobs"].append(_finite(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += text_length([lp], text)
    return out


def prompt_completion_logprobs(lps: list[TokenLogprob | None], prompt_ids: list[int],
                               text: TokenText) -> dict[str, Any]:
    """The echoed prompt's part of the legacy shape: its first token has no logprob."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    offset = 0
    for token_id, lp in zip(prompt_ids, lps, strict=True):
        if lp is None:
            out["tokens"].append(text(token_id)[0])
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
            offset += text_length([TokenLogprob(token_id, 0.0)], text)
            continue
        part = completion_logprobs([lp], text, offset)
        for key in out:
            out[key].extend(part[key])
        offset += text_length([lp], text)
    return out


def vllm_prompt_logprobs(lps: Sequence[TokenLogprob | None], text: TokenText,
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) its own entry
    then the top-N, each ``{token id: {logprob, rank, decoded_token}}`` (the token's
    text, also where the logprobs write tokens as ids, as vLLM does)."""

    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text.decoded(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        position = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for i, (t, v) in enumerate(lp.top):
            position.setdefault(str(t), entry(t, v, i + 1))
        out.append(position)
    return out


def top_n(lps: Sequence[TokenLogprob | None], n: int) -> list[TokenLogprob | None]:
    """The prompt's logprobs with each position's top-N cut to ``n`` (the engine
    computed the largest N the request asked for)."""
    return [lp if lp is None else lp._replace(top=lp.top[:n]) for lp in lps]


def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(lps: list[TokenLogprob], text: TokenText) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token, raw = text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(raw)}

    return [{**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def merged_usage(finals: Sequence[FinalChunk], n: int = 1) -> Usage:
    """The usage of a request's choices, ``n`` per prompt (prompt-major): each prompt
    counted once, outputs summed."""
    firsts = [f.usage for f in finals[::n]]
    predicted = [f.usage.prediction_tokens for f in finals if f.usage.prediction_tokens]
    return Usage(sum(u.prompt_tokens for u in firsts),
                 sum(f.usage.completion_tokens for f in finals),
                 sum(u.cached_tokens for u in firsts),
                 (sum(a for a, _ in predicted), sum(r for _, r in predicted))
                 if predicted else None)
