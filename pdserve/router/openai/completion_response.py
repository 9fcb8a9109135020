"""``/v1/completions``' response objects (``text_completion``): the text on each
choice, logprobs in the legacy shape (``text_offset``), and ``echo``: each prompt
leads its choices' output, with its tokens' logprobs when logprobs are asked for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.router.openai.response_builder import (
    ChoiceState,
    PromptLogprobs,
    ResponseBuilder,
)
from pdserve.router.openai.response_objects import (
    completion_logprobs,
    prompt_completion_logprobs,
    text_length,
    top_n,
)
from pdserve.router.types import FinalChunk, StreamChunk, TokenLogprob


class CompletionBuilder(ResponseBuilder):
    """``echo``: each prompt's (text, token ids), which lead its choices' output;
    ``echo_top``: the echoed prompt's logprobs' top-N (the body's ``logprobs``)."""

    id_prefix, object_kind, chunk_kind = "cmpl-", "text_completion", "text_completion"

    def __init__(self, *, echo: Sequence[tuple[str, list[int]]] | None = None,
                 echo_top: int = 0, **common: Any):
        self._echo = echo
        self._echo_top = echo_top
        super().__init__(**common)

    def _new_choice(self, prompt: int) -> ChoiceState:
        return ChoiceState(None, None if self._echo is None else self._echo[prompt])

    def _logprobs_shape(self, c: ChoiceState, lps: list[TokenLogprob]) -> dict[str, Any]:
        return completion_logprobs(lps, self._text, c.offset)

    def _put_prompt_ids(self, chunk: dict[str, Any], ids: list[int]) -> None:
        chunk["choices"][0]["prompt_token_ids"] = ids

    def _put_text(self, choice: dict[str, Any], c: ChoiceState, item: StreamChunk) -> None:
        choice["text"] = item.text
        c.offset += text_length(item.logprobs, self._text)

    def _put_end(self, choice: dict[str, Any]) -> None:
        choice["text"] = ""

    def _put_whole(self, choice: dict[str, Any], index: int, c: ChoiceState, text: str,
                   final: FinalChunk, prompt_lps: list[PromptLogprobs]) -> None:
        choice["text"] = text
        if prompt_lps:
            choice["prompt_logprobs"] = prompt_lps[-1]
        if self._prompt_ids is not None:
            choice["prompt_token_ids"] = self._prompt_ids[index // self._n]

    def _put_top(self, out: dict[str, Any], prompt_lps: list[PromptLogprobs]) -> None:
        """Nothing: a completion's prompt logprobs and token ids are on its choices."""

    def _prompt_part(self, c: ChoiceState, lps: list[TokenLogprob | None] | None,
                     ) -> tuple[str, dict[str, Any] | None]:
        if c.echo is None or c.echoed:
            return "", None
        c.echoed = True
        text, ids = c.echo
        logprobs = None
        if self._logprobs:
            logprobs = prompt_completion_logprobs(
                top_n(lps, self._echo_top) if lps else [None] * len(ids), ids, self._text)
        c.offset += len(text)
        return text, logprobs

    def _echo_chunk(self, c: ChoiceState, index: int,
                    lps: list[TokenLogprob | None] | None) -> list[dict[str, Any]]:
        text, logprobs = self._prompt_part(c, lps)
        if not text and logprobs is None:
            return []
        return [self._envelope([{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": None}], True)]

    def _opening(self, c: ChoiceState, index: int, item: StreamChunk) -> list[dict[str, Any]]:
        return self._echo_chunk(c, index, item.prompt_logprobs)

    def _closing(self, c: ChoiceState, index: int, final: FinalChunk) -> list[dict[str, Any]]:
        return self._echo_chunk(c, index, final.prompt_logprobs)
