"""Chat messages as the chat template takes them: the message and tool models every
chat body shares (chat completions, tokenize; the Responses API maps to them), the
chat template's extras (``ChatTemplateFields``, gRPC's too) and the rendering of a
conversation with tools (``chat_messages``)."""

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from pdserve.router.openai.request_models import Body, InvalidRequest, JsonSchema, NonEmpty
from pdserve.router.openai.tool_parsers.base import ToolSyntax


class ContentPart(Body):
    type: Literal["text"]  # images, audio, files: not supported
    text: str


class CalledFunction(Body):
    name: NonEmpty
    arguments: str  # JSON text


class MessageToolCall(Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Body):
    # developer: OpenAI's newer name for system instructions (rendered as system)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: assistant messages only
    tool_calls: list[MessageToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call answered


class FunctionDef(Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: JsonSchema | None = None  # None: no parameters
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class ChatTemplateFields(Body):
    """vLLM's chat extras: how the chat template renders the messages
    (``Tokenizer.render_chat``), checked by ``template_args``."""

    add_generation_prompt: bool = True
    # the answer continues the final message (set add_generation_prompt false)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    documents: list[dict[str, str]] | None = None  # for a template that renders them (RAG)

    def template_args(self) -> dict[str, Any]:
        """The chat extras as ``Tokenizer.apply_chat_template``'s keywords; InvalidRequest
        for a pair it cannot take (what only rendering finds, e.g. an empty final message
        to continue, is the prompt's error then)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message=true needs add_generation_prompt=false "
                                 "(the answer continues the final message, not a new turn)",
                                 "continue_final_message")
        kwargs = self.chat_template_kwargs or {}
        taken = sorted({"messages", "tools", "add_generation_prompt", "documents"} & kwargs.keys())
        if taken:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)} (the "
                                 "request's own fields set them)", "chat_template_kwargs")
        if self.documents is not None:
            kwargs = {**kwargs, "documents": self.documents}
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "template_kwargs": kwargs}


def chat_messages(messages: list[ChatMessage], syntax: ToolSyntax,
                  tools: list[dict[str, Any]] | None = None,
                  native: bool = False) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text content parts joined. With
    ``native`` (a template that renders tools itself) earlier tool calls stay structured
    (HF's convention: ``tool_calls`` with the arguments as an object) and the template
    is given ``tools``; otherwise earlier calls and tool results are written in
    ``syntax`` and ``tools`` (OpenAI tool objects) declared in a system prompt."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role  # as /v1/responses, vLLM
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise InvalidRequest(f"messages[{i}].content is required", "messages")
            content = ""
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls is only allowed in assistant "
                                 "messages", "messages")
        if native:
            msg: dict[str, Any] = {"role": role, "content": content}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
            continue
        if m.tool_calls:
            calls = syntax.render_calls([(c.function.name, c.function.arguments)
                                         for c in m.tool_calls])
            content = f"{content}\n{calls}" if content else calls
        elif m.role == "tool":
            content = syntax.render_result(content)
        out.append({"role": role, "content": content})
    return syntax.with_tools(out, tools) if tools and not native else out


def _arguments(text: str) -> Any:
    """A call's JSON arguments as an object (what templates render), or the text as
    the client sent it when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text
