"""``/v1/chat/completions``' response objects (``chat.completion``, streamed as
``chat.completion.chunk``): the assistant message (a stream's first chunk carries
the role), logprobs in chat's shape, vLLM's chat ``echo``, and with tools the
``tool_calls`` read out of the output in the model family's syntax (streamed: text
that could still open a call is held back, its logprobs ride on the next chunk)."""

from __future__ import annotations

from typing import Any

from pdserve.router.openai.response_builder import (
    ChoiceState,
    PromptLogprobs,
    ResponseBuilder,
    finish_reason,
)
from pdserve.router.openai.response_objects import chat_logprobs
from pdserve.router.openai.tool_parsers.base import (
    Event,
    ToolCall,
    ToolSyntax,
    call_deltas,
    call_object,
)
from pdserve.router.types import FinalChunk, StreamChunk, TokenLogprob


class ChatBuilder(ResponseBuilder):
    """``tools``: the output's tool calls are read with this syntax (``tool_calls``
    instead of content); ``chat_echo``: vLLM's chat echo, the text the answer's content
    begins with."""

    id_prefix, object_kind, chunk_kind = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, *, tools: ToolSyntax | None = None, chat_echo: str = "", **common: Any):
        self._tools = tools
        self._chat_echo = chat_echo
        super().__init__(**common)

    def _new_choice(self, prompt: int) -> ChoiceState:
        return ChoiceState(self._tools.stream() if self._tools is not None else None, None)

    def _logprobs_shape(self, c: ChoiceState, lps: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": chat_logprobs(lps, self._text), "refusal": None}

    def _put_prompt_ids(self, chunk: dict[str, Any], ids: list[int]) -> None:
        chunk["prompt_token_ids"] = ids

    def _put_text(self, choice: dict[str, Any], c: ChoiceState, item: StreamChunk) -> None:
        choice["delta"] = {"content": item.text}

    def _put_end(self, choice: dict[str, Any]) -> None:
        choice["delta"] = {}

    def _put_whole(self, choice: dict[str, Any], index: int, c: ChoiceState, text: str,
                   final: FinalChunk, prompt_lps: list[PromptLogprobs]) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self._tools is not None:
            content, calls = self._tools.parse(text)
            if calls:
                message["content"] = content
                message["tool_calls"] = [call_object(call) for call in calls]
                choice["finish_reason"] = finish_reason(final, len(calls))
        if self._chat_echo:
            message["content"] = self._chat_echo + (message["content"] or "")
        choice["message"] = message

    def _put_top(self, out: dict[str, Any], prompt_lps: list[PromptLogprobs]) -> None:
        if prompt_lps:  # vLLM: the response's (one prompt)
            out["prompt_logprobs"] = prompt_lps[0]
        if self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids[0]

    def _opening(self, c: ChoiceState, index: int, item: StreamChunk) -> list[dict[str, Any]]:
        if c.started:
            return []
        c.started = True
        return [self._envelope([{"index": index,
                                 "delta": {"role": "assistant", "content": self._chat_echo},
                                 "logprobs": None, "finish_reason": None}], True)]

    def _closing(self, c: ChoiceState, index: int, final: FinalChunk) -> list[dict[str, Any]]:
        out = [] if c.started else self.chunk(StreamChunk([], ""), index)
        if c.tools is not None:
            out += self._tool_chunks(index, c.tools.finish(), [])
        return out

    def _content_chunks(self, c: ChoiceState, index: int,
                        item: StreamChunk) -> list[dict[str, Any]]:
        if c.tools is None:
            return super()._content_chunks(c, index, item)
        return self._tool_chunks(index, c.tools.feed(item.text), item.logprobs)

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
