"""The ``/v1/completions`` body (``CompletionRequest``), the fields it refuses, and its
mapping to router requests (``to_router``: one per prompt)."""

from typing import Annotated, Any

from pydantic import Field

from pdserve.router.openai.request_models import (
    EMPTY,
    MAX_N,
    VLLM_UNIMPLEMENTED,
    InvalidRequest,
    Refused,
    TokenId,
    TopN,
    only,
    validate_body,
)
from pdserve.router.openai.sampling_fields import Plan, SamplingFields, only_one
from pdserve.router.types import GenerateRequest

MAX_PROMPTS = 64  # prompts per completions request (a batch, as lm-eval's batch_size sends)


class CompletionRequest(SamplingFields):
    # a text, token ids, or a batch of either (n choices of each, indexes prompt-major)
    prompt: (str | list[TokenId]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: TopN | None = None  # top-N per token (OpenAI allows 0..5, we 0..20)
    # the prompt leads the output; with logprobs, its tokens' logprobs too (the first
    # token's are null), as in OpenAI's legacy API and vLLM
    echo: bool = False
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with echo (scoring)
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # equal to n (no ranking)

    @classmethod
    def parse(cls, body: Any) -> "CompletionRequest":
        """A body read by the route's rule (``validate_body``); InvalidRequest."""
        r: CompletionRequest = validate_body(cls, body, REFUSED_COMPLETION)
        return r

    def to_router(self, request_id: str) -> tuple[list[GenerateRequest], Plan]:
        """(A router request per prompt, plan); InvalidRequest. A batch of prompts: ids
        ``{id}-{i}``; one prompt: ``{id}``."""
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise InvalidRequest("max_tokens must be >= 1 (0 only with echo or "
                                 "prompt_logprobs: the prompt alone)", "max_tokens")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequest(f"best_of={self.best_of} must equal n={self.n or 1}: returning "
                                 "the best of more candidates than n is not supported", "best_of")
        constraints = self.output_constraints()
        # echo + logprobs: the prompt's logprobs; max_tokens 0 computes them anyway
        echo_logprobs = (self.logprobs if self.logprobs is not None else 0
                         if self.max_tokens == 0 else None) if self.echo else None
        asked = [n for n in (echo_logprobs, self.prompt_logprobs) if n is not None]
        params = self.sampling_params(self.max_tokens, self.logprobs, {},
                                      max(asked) if asked else None, only_one(constraints))
        self.check_beam_search(params, constraints, [("echo", self.echo)])
        batch = (isinstance(self.prompt, list) and bool(self.prompt)
                 and isinstance(self.prompt[0], str | list))
        prompts: list[Any] = list(self.prompt) if batch else [self.prompt]
        reqs = []
        for i, prompt in enumerate(prompts):
            req = GenerateRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                  params, timeout_s=self.timeout_s,
                                  bad_words=tuple(self.bad_words or ()),
                                  truncate_prompt_tokens=self.truncate_prompt_tokens)
            if isinstance(prompt, str):
                req.prompt = prompt
            else:
                req.prompt_token_ids = list(prompt)
            reqs.append(req)
        return reqs, Plan(constraints)


# Field -> its harmless values. Anything else is refused with a 400 naming it.
REFUSED_COMPLETION: dict[str, Refused] = {
    "suffix": EMPTY,
    **VLLM_UNIMPLEMENTED,
    "add_special_tokens": only(None, True),
    "prompt_embeds": only(None),
}
