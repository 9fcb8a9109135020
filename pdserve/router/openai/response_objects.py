"""OpenAI response objects built from the router's streams: completion and chat
responses and stream chunks (``n`` choices, one stream each), ``usage``, logprobs in
OpenAI's two shapes, token strings, the error object with its HTTP status, and for
chat with tools the ``tool_calls`` found in the output (``tool_parsers`` parses them).

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
from pdserve.router.openai.tool_parsers.base import (
    Event,
    ToolCall,
    ToolStream,
    ToolSyntax,
    call_deltas,
    call_object,
)
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    RouterError,
    StreamChunk,
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


def _top_n(lps: Sequence[TokenLogprob | None], n: int) -> list[TokenLogprob | None]:
    """The prompt's logprobs with each position's top-N cut to ``n`` (the engine
    computed the largest N the request asked for)."""
    return [lp if lp is None else lp._replace(top=lp.top[:n]) for lp in lps]


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
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


class _Choice:
    """One choice's progress through the response."""

    def __init__(self, tools: ToolStream | None, echo: tuple[str, list[int]] | None):
        self.echo = echo  # completions with echo: its prompt's (text, token ids)
        self.echoed = False
        self.offset = 0  # completions text_offset: output characters so far
        self.started = False  # chat: the first chunk carries the role
        self.pieces: list[str] = []
        self.lps: list[TokenLogprob] = []
        self.prompt_lps: list[TokenLogprob | None] | None = None
        self.tools = tools  # chat streams with tools: the parser of this choice's calls
        self.held_lps: list[TokenLogprob] = []  # logprobs of text the parser holds back
        self.calls = 0  # tool calls streamed so far
        self.usage = Usage(0, 0)  # streamed: prompt and output tokens so far
        self.ids: list[int] = []  # return_token_ids: output ids (whole) / not yet sent
        self.ids_started = False  # streamed: the prompt's ids went with the first chunk


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


class ResponseBuilder:
    """One request's response objects, streamed (``chunk``/``final_chunks``) or whole
    (``add`` then ``response``), for ``n`` choices of each of ``prompts`` prompts
    (choice ``p * n + i``; each call names its choice's index). ``chat`` picks the
    endpoint's shapes; ``tools``: the chat output's tool calls are read with this
    syntax (``tool_calls`` instead of content); ``echo`` (completions): each prompt's
    (text, token ids), which lead its choices' output."""

    def __init__(self, *, chat: bool, request_id: str, model: str, created: int,
                 text: TokenText, logprobs: bool, include_usage: bool = False,
                 continuous_usage: bool = False, prompt_logprobs: int | None = None,
                 echo_top: int = 0, chat_echo: str = "",
                 prompt_ids: Sequence[list[int]] | None = None,
                 echo: Sequence[tuple[str, list[int]]] | None = None, n: int = 1,
                 prompts: int = 1, tools: ToolSyntax | None = None):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = created
        self._text = text
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._continuous_usage = include_usage and continuous_usage
        self._prompt_logprobs = prompt_logprobs  # vLLM's field: its top-N
        self._echo_top = echo_top  # echo's prompt logprobs: top-N (logprobs)
        self._chat_echo = chat_echo  # vLLM's chat echo: the message the answer continues
        self._prompt_ids = prompt_ids  # vLLM's return_token_ids: each prompt's ids
        self._tools = tools
        self._n = n
        self._choices = [_Choice(tools.stream() if tools is not None else None,
                                 None if echo is None else echo[i // n])
                         for i in range(n * prompts)]
        self._finals: dict[int, FinalChunk] = {}  # streamed: the choices finished so far

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if stream and self.chat else "")
        obj = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
               "choices": choices}
        if stream and self._include_usage:
            obj["usage"] = None
            if self._continuous_usage and choices:  # vLLM's continuous_usage_stats
                u = self._choices[choices[0]["index"]].usage
                obj["usage"] = {"prompt_tokens": u.prompt_tokens,
                                "completion_tokens": u.completion_tokens,
                                "total_tokens": u.prompt_tokens + u.completion_tokens}
        return obj

    def _logprobs_of(self, c: _Choice, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        if self.chat:
            return {"content": chat_logprobs(lps, self._text), "refusal": None}
        return completion_logprobs(lps, self._text, c.offset)

    def _prompt_part(self, c: _Choice, lps: list[TokenLogprob | None] | None,
                     ) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text and logprobs (once; ("", None) without echo)."""
        if c.echo is None or c.echoed:
            return "", None
        c.echoed = True
        text, ids = c.echo
        logprobs = None
        if self._logprobs:
            logprobs = prompt_completion_logprobs(
                _top_n(lps, self._echo_top) if lps else [None] * len(ids), ids, self._text)
        c.offset += len(text)
        return text, logprobs

    def _echo_chunk(self, index: int, lps: list[TokenLogprob | None] | None,
                    ) -> list[dict[str, Any]]:
        text, logprobs = self._prompt_part(self._choices[index], lps)
        if not text and logprobs is None:
            return []
        return [self._envelope([{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": None}], True)]

    def _tool_chunks(self, index: int, events: list[Event], lps: list[TokenLogprob],
                     ) -> list[dict[str, Any]]:
        """Chunks for what the choice's tool parser let through; logprobs of held text
        ride on the next chunk."""
        c = self._choices[index]
        c.held_lps += lps
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ToolCall):
                deltas += [{"tool_calls": [d]} for d in call_deltas(c.calls, event)]
                c.calls += 1
            elif deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += event
            else:
                deltas.append({"content": event})
        out = []
        for delta in deltas:
            out.append(self._envelope([{"index": index, "delta": delta,
                                        "logprobs": self._logprobs_of(c, c.held_lps),
                                        "finish_reason": None}], True))
            c.held_lps = []
        return out

    def _with_ids(self, index: int, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """vLLM's ``return_token_ids``: every chunk of the choice has ``token_ids``, the
        ids not yet sent on its last one; its first carries the prompt's (chat: on the
        chunk itself)."""
        if self._prompt_ids is None or not chunks:
            return chunks
        c = self._choices[index]
        if not c.ids_started:
            c.ids_started = True
            ids = self._prompt_ids[index // self._n]
            if self.chat:
                chunks[0]["prompt_token_ids"] = ids
            else:
                chunks[0]["choices"][0]["prompt_token_ids"] = ids
        for chunk in chunks[:-1]:
            chunk["choices"][0]["token_ids"] = []
        chunks[-1]["choices"][0]["token_ids"] = c.ids
        c.ids = []
        return chunks

    def chunk(self, item: StreamChunk, index: int = 0) -> list[dict[str, Any]]:
        """Stream chunks for new tokens (none when there is nothing to show yet)."""
        self._choices[index].ids += item.token_ids
        return self._with_ids(index, self._chunks(item, index))

    def _chunks(self, item: StreamChunk, index: int) -> list[dict[str, Any]]:
        c = self._choices[index]
        c.usage = Usage(item.prompt_tokens or c.usage.prompt_tokens,
                        c.usage.completion_tokens + len(item.token_ids))
        out = self._echo_chunk(index, item.prompt_logprobs)
        if self.chat and not c.started:
            c.started = True
            out.append(self._envelope([{"index": index,
                                        "delta": {"role": "assistant",
                                                  "content": self._chat_echo},
                                        "logprobs": None, "finish_reason": None}], True))
        if c.tools is not None:
            return out + self._tool_chunks(index, c.tools.feed(item.text), item.logprobs)
        if not item.text and not (self._logprobs and item.logprobs):
            return out
        choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs_of(c, item.logprobs),
                                  "finish_reason": None}
        if self.chat:
            choice["delta"] = {"content": item.text}
        else:
            choice["text"] = item.text
            c.offset += text_length(item.logprobs, self._text)
        out.append(self._envelope([choice], True))
        return out

    def final_chunks(self, final: FinalChunk, index: int = 0) -> list[dict[str, Any]]:
        """The choice's finishing chunk, then, once every choice has finished, the usage
        chunk when the client asked for it."""
        c = self._choices[index]
        c.usage = final.usage
        out = [] if not self.chat or c.started else self.chunk(StreamChunk([], ""), index)
        if c.tools is not None:
            out += self._tool_chunks(index, c.tools.finish(), [])
        out += self._echo_chunk(index, final.prompt_logprobs)
        choice: dict[str, Any] = {"index": index, "logprobs": None,
                                  "finish_reason": _finish_reason(final, c.calls),
                                  "stop_reason": final.stop_reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        out.append(self._envelope([choice], True))
        out = self._with_ids(index, out)
        self._finals[index] = final
        if self._include_usage and len(self._finals) == len(self._choices):
            usage = merged_usage([self._finals[i] for i in range(len(self._choices))], self._n)
            out.append({**self._envelope([], True), "usage": usage_object(usage)})
        return out

    def add(self, item: StreamChunk, index: int = 0) -> None:
        c = self._choices[index]
        if item.prompt_logprobs is not None:
            c.prompt_lps = item.prompt_logprobs
        c.pieces.append(item.text)
        c.lps.extend(item.logprobs)
        c.ids += item.token_ids

    def response(self, finals: Sequence[FinalChunk]) -> dict[str, Any]:
        """The whole response; ``finals``: each choice's final chunk, by index."""
        choices = []
        vllm_prompt = []  # vLLM's prompt_logprobs of each choice
        for index, (c, final) in enumerate(zip(self._choices, finals, strict=True)):
            lps = final.prompt_logprobs if final.prompt_logprobs is not None else c.prompt_lps
            prompt_text, prompt_lps = self._prompt_part(c, lps)
            if self._prompt_logprobs is not None:
                vllm_prompt.append(vllm_prompt_logprobs(
                    _top_n(lps or [], self._prompt_logprobs), self._text))
            text = prompt_text + "".join(c.pieces)
            logprobs = self._logprobs_of(c, c.lps)
            if prompt_lps is not None:
                logprobs = _joined(prompt_lps, logprobs)
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                      "finish_reason": final.finish_reason,
                                      "stop_reason": final.stop_reason}
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
                if self._tools is not None:
                    content, calls = self._tools.parse(text)
                    if calls:
                        message["content"] = content
                        message["tool_calls"] = [call_object(call) for call in calls]
                        choice["finish_reason"] = _finish_reason(final, len(calls))
                if self._chat_echo:
                    message["content"] = self._chat_echo + (message["content"] or "")
                choice["message"] = message
            else:
                choice["text"] = text
                if vllm_prompt:
                    choice["prompt_logprobs"] = vllm_prompt[-1]
                if self._prompt_ids is not None:
                    choice["prompt_token_ids"] = self._prompt_ids[index // self._n]
            if self._prompt_ids is not None:
                choice["token_ids"] = c.ids
            choices.append(choice)
        out = {**self._envelope(choices, False),
               "usage": usage_object(merged_usage(finals, self._n))}
        if self.chat and vllm_prompt:  # vLLM: the response's (one prompt)
            out["prompt_logprobs"] = vllm_prompt[0]
        if self.chat and self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids[0]
        return out


def _finish_reason(final: FinalChunk, calls: int) -> str:
    """``tool_calls`` when the output ended normally after calling tools."""
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
