"""``POST /v1/chat/completions``: messages rendered by the model's chat template (with
the tools the body declares), ``n`` choices, answered as ``chat.completion`` objects
with the tool calls read out of the output (``openai.chat_request`` maps the body)."""

from __future__ import annotations

from typing import Any

from pdserve.router.http.endpoint import GenerateEndpoint, Prepared
from pdserve.router.openai.chat_request import ChatCompletionRequest
from pdserve.router.openai.chat_response import ChatBuilder
from pdserve.router.openai.response_builder import ResponseBuilder


class Chat(GenerateEndpoint[ChatCompletionRequest]):
    def prepare(self, body: Any, rid: str) -> Prepared[ChatCompletionRequest]:
        r = ChatCompletionRequest.parse(body)
        tok = self.router.tokenizer
        req, plan = r.to_router(
            rid, lambda m, t, kw: len(tok.apply_chat_template(m, tools=t, **kw)),
            self.router.models()[0].max_model_len, self.served.tools, tok.renders_tools)
        # The router's fields the body names otherwise: its prompt is its messages, its
        # limit the one it set.
        limit = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        return Prepared(r, [req], plan, {"prompt": "messages", "max_tokens": limit})

    def builder(self, p: Prepared[ChatCompletionRequest], prompt_ids: list[list[int]] | None,
                echo: list[tuple[str, list[int]]] | None, **common: Any) -> ResponseBuilder:
        return ChatBuilder(logprobs=p.body.logprobs, chat_echo=p.body.echo_text(),
                           prompt_ids=prompt_ids, tools=p.plan.tools, **common)
