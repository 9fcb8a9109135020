"""``POST /v1/completions``: a prompt, token ids, or a batch of either, ``n`` choices
each (choice ``p * n + i``), answered as ``text_completion`` objects; ``echo`` leads
each choice with its prompt (``openai.completion_request`` maps the body)."""

from __future__ import annotations

from typing import Any

from pdserve.router.http.endpoint import GenerateEndpoint, Prepared
from pdserve.router.openai.completion_request import CompletionRequest
from pdserve.router.openai.completion_response import CompletionBuilder
from pdserve.router.openai.response_builder import ResponseBuilder


class Completions(GenerateEndpoint[CompletionRequest]):
    def prepare(self, body: Any, rid: str) -> Prepared[CompletionRequest]:
        r = CompletionRequest.parse(body)
        reqs, plan = r.to_router(rid)
        return Prepared(r, reqs, plan, {}, echo=r.echo)

    def builder(self, p: Prepared[CompletionRequest], prompt_ids: list[list[int]] | None,
                echo: list[tuple[str, list[int]]] | None, **common: Any) -> ResponseBuilder:
        return CompletionBuilder(logprobs=p.body.logprobs is not None,
                                 echo_top=p.body.logprobs or 0, prompt_ids=prompt_ids,
                                 echo=echo, **common)
