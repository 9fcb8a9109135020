"""One request's response objects built from the router's streams (``n`` choices, one
stream each): what every endpoint's shapes share (``ResponseBuilder``: the envelope,
usage, logprobs, token ids, the order of a stream's chunks); each endpoint's builder
(``completion_response.CompletionBuilder``, ``chat_response.ChatBuilder``) puts its
own fields where its hooks say."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pdserve.router.openai.response_objects import (
    TokenText,
    joined,
    merged_usage,
    top_n,
    usage_object,
    vllm_prompt_logprobs,
)
from pdserve.router.openai.tool_parsers.base import ToolStream
from pdserve.router.types import FinalChunk, StreamChunk, TokenLogprob, Usage

PromptLogprobs = list[dict[str, dict[str, Any]] | None]  # vLLM's, of one choice


class ChoiceState:
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


class ResponseBuilder(ABC):
    """One request's response objects, streamed (``chunk``/``final_chunks``) or whole
    (``add`` then ``response``), for ``n`` choices of each of ``prompts`` prompts
    (choice ``p * n + i``; each call names its choice's index). ``logprobs``: the
    output's, in the endpoint's shape; ``prompt_logprobs``: vLLM's, their top-N;
    ``prompt_ids``: vLLM's ``return_token_ids``, each prompt's ids."""

    id_prefix: str  # the response id's, before the request id
    object_kind: str  # a whole response's ``object``
    chunk_kind: str  # a stream chunk's ``object``

    def __init__(self, *, request_id: str, model: str, created: int, text: TokenText,
                 logprobs: bool, include_usage: bool = False, continuous_usage: bool = False,
                 prompt_logprobs: int | None = None,
                 prompt_ids: Sequence[list[int]] | None = None, n: int = 1, prompts: int = 1):
        self.id = self.id_prefix + request_id
        self.model = model
        self.created = created
        self._text = text
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._continuous_usage = include_usage and continuous_usage
        self._prompt_logprobs = prompt_logprobs  # vLLM's field: its top-N
        self._prompt_ids = prompt_ids  # vLLM's return_token_ids: each prompt's ids
        self._n = n
        self._choices = [self._new_choice(i // n) for i in range(n * prompts)]
        self._finals: dict[int, FinalChunk] = {}  # streamed: the choices finished so far

    # ------------------------------------------------------------- the endpoint's hooks

    @abstractmethod
    def _new_choice(self, prompt: int) -> ChoiceState:
        """The state of a choice of prompt ``prompt``."""

    @abstractmethod
    def _logprobs_shape(self, c: ChoiceState, lps: list[TokenLogprob]) -> dict[str, Any]:
        """The output logprobs ``lps`` of choice ``c`` in the endpoint's shape."""

    @abstractmethod
    def _put_prompt_ids(self, chunk: dict[str, Any], ids: list[int]) -> None:
        """``return_token_ids``: the prompt's ids on a choice's first chunk."""

    @abstractmethod
    def _put_text(self, choice: dict[str, Any], c: ChoiceState, item: StreamChunk) -> None:
        """A stream chunk's new text on its choice object."""

    @abstractmethod
    def _put_end(self, choice: dict[str, Any]) -> None:
        """The (empty) text of a choice's finishing chunk."""

    @abstractmethod
    def _put_whole(self, choice: dict[str, Any], index: int, c: ChoiceState, text: str,
                   final: FinalChunk, prompt_lps: list[PromptLogprobs]) -> None:
        """A whole response's choice: its ``text`` (echo included) and what else the
        endpoint puts there; ``prompt_lps``: vLLM's prompt logprobs so far, by choice."""

    @abstractmethod
    def _put_top(self, out: dict[str, Any], prompt_lps: list[PromptLogprobs]) -> None:
        """What the endpoint puts on the whole response itself."""

    def _opening(self, c: ChoiceState, index: int, item: StreamChunk) -> list[dict[str, Any]]:
        """The chunks before a stream item's own."""
        return []

    def _closing(self, c: ChoiceState, index: int, final: FinalChunk) -> list[dict[str, Any]]:
        """The chunks before a choice's finishing one."""
        return []

    def _prompt_part(self, c: ChoiceState, lps: list[TokenLogprob | None] | None,
                     ) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text and logprobs (once; ("", None) without echo)."""
        return "", None

    def _content_chunks(self, c: ChoiceState, index: int,
                        item: StreamChunk) -> list[dict[str, Any]]:
        """The chunk of a stream item's text and logprobs (none when there are none)."""
        if not item.text and not (self._logprobs and item.logprobs):
            return []
        choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs_of(c, item.logprobs),
                                  "finish_reason": None}
        self._put_text(choice, c, item)
        return [self._envelope([choice], True)]

    # ------------------------------------------------------------- shared

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        obj = {"id": self.id, "object": self.chunk_kind if stream else self.object_kind,
               "created": self.created, "model": self.model, "choices": choices}
        if stream and self._include_usage:
            obj["usage"] = None
            if self._continuous_usage and choices:  # vLLM's continuous_usage_stats
                u = self._choices[choices[0]["index"]].usage
                obj["usage"] = {"prompt_tokens": u.prompt_tokens,
                                "completion_tokens": u.completion_tokens,
                                "total_tokens": u.prompt_tokens + u.completion_tokens}
        return obj

    def _logprobs_of(self, c: ChoiceState, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        return self._logprobs_shape(c, lps) if self._logprobs else None

    def _with_ids(self, index: int, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """vLLM's ``return_token_ids``: every chunk of the choice has ``token_ids``, the
        ids not yet sent on its last one; its first carries the prompt's."""
        if self._prompt_ids is None or not chunks:
            return chunks
        c = self._choices[index]
        if not c.ids_started:
            c.ids_started = True
            self._put_prompt_ids(chunks[0], self._prompt_ids[index // self._n])
        for chunk in chunks[:-1]:
            chunk["choices"][0]["token_ids"] = []
        chunks[-1]["choices"][0]["token_ids"] = c.ids
        c.ids = []
        return chunks

    def chunk(self, item: StreamChunk, index: int = 0) -> list[dict[str, Any]]:
        """Stream chunks for new tokens (none when there is nothing to show yet)."""
        self._choices[index].ids += item.token_ids
        c = self._choices[index]
        c.usage = Usage(item.prompt_tokens or c.usage.prompt_tokens,
                        c.usage.completion_tokens + len(item.token_ids))
        out = self._opening(c, index, item) + self._content_chunks(c, index, item)
        return self._with_ids(index, out)

    def final_chunks(self, final: FinalChunk, index: int = 0) -> list[dict[str, Any]]:
        """The choice's finishing chunk, then, once every choice has finished, the usage
        chunk when the client asked for it."""
        c = self._choices[index]
        c.usage = final.usage
        out = self._closing(c, index, final)
        choice: dict[str, Any] = {"index": index, "logprobs": None,
                                  "finish_reason": finish_reason(final, c.calls),
                                  "stop_reason": final.stop_reason}
        self._put_end(choice)
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
        vllm_prompt: list[PromptLogprobs] = []  # vLLM's prompt_logprobs of each choice
        for index, (c, final) in enumerate(zip(self._choices, finals, strict=True)):
            lps = final.prompt_logprobs if final.prompt_logprobs is not None else c.prompt_lps
            prompt_text, prompt_lps = self._prompt_part(c, lps)
            if self._prompt_logprobs is not None:
                vllm_prompt.append(vllm_prompt_logprobs(
                    top_n(lps or [], self._prompt_logprobs), self._text))
            text = prompt_text + "".join(c.pieces)
            logprobs = self._logprobs_of(c, c.lps)
            if prompt_lps is not None:
                logprobs = joined(prompt_lps, logprobs)
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                      "finish_reason": final.finish_reason,
                                      "stop_reason": final.stop_reason}
            self._put_whole(choice, index, c, text, final, vllm_prompt)
            if self._prompt_ids is not None:
                choice["token_ids"] = c.ids
            choices.append(choice)
        out = {**self._envelope(choices, False),
               "usage": usage_object(merged_usage(finals, self._n))}
        self._put_top(out, vllm_prompt)
        return out


def finish_reason(final: FinalChunk, calls: int) -> str:
    """``tool_calls`` when the output ended normally after calling tools."""
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
