"""The ``/v1/chat/completions`` body (``ChatCompletionRequest``), the fields it refuses,
and its mapping to the router's request (``to_router``): the messages rendered with
the tools, the calls forced by ``tool_choice``, the token limit."""

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.router.openai.chat_messages import (
    ChatMessage,
    ChatTemplateFields,
    ContentPart,
    Tool,
    chat_messages,
)
from pdserve.router.openai.request_models import (
    EMPTY,
    OWN_TEMPLATE,
    VLLM_UNIMPLEMENTED,
    Body,
    InvalidRequest,
    NonEmpty,
    Refused,
    TopN,
    only,
    validate_body,
)
from pdserve.router.openai.sampling_fields import (
    Named,
    Plan,
    SamplingFields,
    constraint,
    only_one,
)
from pdserve.router.openai.tool_parsers.base import ToolSyntax
from pdserve.router.types import GenerateRequest


class FunctionName(Body):
    name: NonEmpty


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class Prediction(Body):
    """OpenAI's predicted output: what the answer is expected to be (a file being
    edited, say). The decoding worker drafts from it; the answer is unchanged."""

    type: Literal["content"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopN | None = None  # needs logprobs
    prediction: Prediction | None = None
    # vLLM's: the answer's content begins with the last message's when the answer
    # continues it (its role is the answer's: continue_final_message)
    echo: bool = False

    @classmethod
    def parse(cls, body: Any) -> "ChatCompletionRequest":
        """A body read by the route's rule (``validate_body``); InvalidRequest."""
        r: ChatCompletionRequest = validate_body(cls, body, REFUSED_CHAT)
        return r

    def to_router(self, request_id: str,
                  prompt_len: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None,
                                        dict[str, Any]], int],
                  max_model_len: int, syntax: ToolSyntax, native_tools: bool = False,
                  ) -> tuple[GenerateRequest, Plan]:
        """(The router request, plan); InvalidRequest. ``syntax``: the model family's
        tool calls (``tool_parsers.syntax_for``); ``native_tools``: the chat template
        renders tools itself (``Tokenizer.renders_tools``).

        ``prompt_len(messages, tools, chat_template_args)`` tokenizes with the chat
        template; it is called only when the client set no token limit (the default is
        the rest of the context).
        """
        offered, schemas, forced = self._tool_constraints(syntax)
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] if offered else None
        messages = chat_messages(self.messages, syntax, tools, native_tools)
        template_tools = tools if native_tools else None
        template = self.template_args()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        constraints = self.output_constraints() + forced
        structured = only_one(constraints)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        own_limit = self.max_completion_tokens is not None
        limit_name = "max_completion_tokens" if own_limit else "max_tokens"
        max_tokens = self.max_completion_tokens if own_limit else self.max_tokens
        if max_tokens is None:
            try:
                n = prompt_len(messages, template_tools, template)
            except ValueError as exc:
                raise InvalidRequest(str(exc), "messages") from exc
            if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens > 0:
                n = min(n, self.truncate_prompt_tokens)
            # a too-long prompt gets the router's 400, or is cut to max_model_len - 1 (-1)
            max_tokens = max(1, max_model_len - n)
        params = self.sampling_params(max_tokens, logprobs,
                                      {"max_tokens": limit_name, "logprobs": "top_logprobs"},
                                      self.prompt_logprobs, structured)
        self.check_beam_search(params, constraints, [("prediction", self.prediction is not None)])
        req = GenerateRequest(
            request_id, params, messages=messages, timeout_s=self.timeout_s,
            tools=template_tools, chat_template_args=template,
            prediction=None if self.prediction is None else self.prediction.text,
            bad_words=tuple(self.bad_words or ()),
            truncate_prompt_tokens=self.truncate_prompt_tokens)
        return req, Plan(schemas + constraints, syntax if offered else None)

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the text the answer's content begins with -- the last
        message's, when its role is the answer's (assistant with ``add_generation_prompt``,
        else the last message's own: the answer continues it)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        content = last.content
        return content if isinstance(content, str) else "".join(p.text for p in content or [])

    def _tool_constraints(self, syntax: ToolSyntax) -> tuple[bool, Named, Named]:
        """(whether the tools are offered to the model, their parameters schemas, which
        must compile, and for ``required`` or a named function the grammar of the calls)."""
        functions = [t.function for t in self.tools or []]
        choice = (self.tool_choice if self.tool_choice is not None
                  else "auto" if functions else "none")
        if choice != "none" and not functions:
            raise InvalidRequest(f"tool_choice={choice!r} needs tools", "tool_choice")
        names = [f.name for f in functions]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise InvalidRequest(f"tools declares function {twice!r} twice", "tools")
        schemas = [constraint(f"tools[{i}].function.parameters", StructuredOutput.json_schema,
                              f.parameters)
                   for i, f in enumerate(functions) if f.parameters is not None]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequest(f"tool_choice names function {choice.function.name!r}, "
                                     "which tools does not declare", "tool_choice")
            called, parallel = [f for f in functions if f.name == choice.function.name], False
        elif choice == "required":
            called, parallel = functions, self.parallel_tool_calls
        else:
            return choice == "auto", schemas, []
        grammar = syntax.grammar([f.model_dump(exclude_none=True) for f in called], parallel)
        return True, schemas, [constraint("tool_choice", StructuredOutput.grammar, grammar)]


REFUSED_CHAT = {
    **VLLM_UNIMPLEMENTED,
    "add_special_tokens": only(None, False),
    "mm_processor_kwargs": EMPTY,
    "chat_template": OWN_TEMPLATE,
    "functions": EMPTY,
    "function_call": only(None, "none", "auto"),
    "audio": EMPTY,
    "modalities": Refused(lambda v: v is None or v == ["text"],
                          {"anyOf": [{"type": "null"}, {"const": ["text"]}]}),
    "web_search_options": EMPTY,
}
