"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, served by the router's tokenizer (no worker is asked).

Applications count a prompt's tokens before they send it, and evaluation harnesses
tokenize with the server's own tokenizer (lm-evaluation-harness'
``tokenizer_backend=remote`` uses all three), so the model's tokenizer need not be
installed beside them. A chat body's tokens are the ones ``/v1/chat/completions``
would prefill for the same messages and tools (one ``chat_messages`` for both); a
prompt's, with the default ``add_special_tokens``, those ``/v1/completions`` would.

Bodies are validated as the generate routes' are (``openai.request_models``); what a body
asks that this server cannot do (a chat template of its own) is refused with a 400
naming the field, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.openai.chat_messages import (
    ChatMessage,
    ChatTemplateFields,
    Tool,
    chat_messages,
)
from pdserve.router.openai.chat_request import REFUSED_CHAT, ChatCompletionRequest
from pdserve.router.openai.completion_request import REFUSED_COMPLETION, CompletionRequest
from pdserve.router.openai.request_models import (
    EMPTY,
    OWN_TEMPLATE,
    Body,
    InvalidRequest,
    Refused,
    known_fields,
    validate_body,
)
from pdserve.router.openai.tool_parsers.base import ToolSyntax


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # tokenizer.json's post-processor, as completions
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    add_special_tokens: bool = False  # the chat template writes its special tokens
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


REFUSED_TOKENIZE_CHAT: dict[str, Refused] = {
    "chat_template": OWN_TEMPLATE,
    "mm_processor_kwargs": EMPTY,
}
# the generate routes' bodies, sent whole to count their prompt: their other fields
# are accepted (and change nothing here)
_CHAT_BODY = known_fields(ChatCompletionRequest) | frozenset(REFUSED_CHAT)
_COMPLETION_BODY = known_fields(CompletionRequest) | frozenset(REFUSED_COMPLETION)


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``/tokenize`` body: a chat one when it has ``messages``; InvalidRequest."""
    if isinstance(body, dict) and "messages" in body:
        chat: TokenizeChatRequest = validate_body(TokenizeChatRequest, body,
                                                  REFUSED_TOKENIZE_CHAT, _CHAT_BODY)
        return chat
    plain: TokenizeCompletionRequest = validate_body(TokenizeCompletionRequest, body,
                                                     besides=_COMPLETION_BODY)
    return plain


def _text(r: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer,
          syntax: ToolSyntax) -> str:
    """The text to tokenize: the prompt, or the chat as chat completions render it."""
    if isinstance(r, TokenizeCompletionRequest):
        return r.prompt
    tools = None if r.tools is None else [t.model_dump(exclude_none=True) for t in r.tools]
    native = tokenizer.renders_tools
    messages = chat_messages(r.messages, syntax, tools, native)
    args = r.template_args()
    try:
        return tokenizer.render_chat(messages, tools=tools if native else None, **args)
    except ValueError as exc:  # the template's refusal
        raise InvalidRequest(f"cannot render the chat: {exc}", "messages") from exc


def tokenize(r: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer,
             syntax: ToolSyntax, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse`` for ``r``: ``count`` may exceed ``max_model_len``
    (nothing is refused for length: that is what a client asks to find out)."""
    text = _text(r, tokenizer, syntax)
    try:
        ids = tokenizer.encode(text, add_special_tokens=r.add_special_tokens)
    except (ValueError, UnicodeError) as exc:  # lone surrogates
        raise InvalidRequest(f"cannot tokenize: {exc}", "prompt" if isinstance(
            r, TokenizeCompletionRequest) else "messages") from exc
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if r.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(r: DetokenizeRequest, tokenizer: Tokenizer) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``: the tokens' text, special tokens included (so
    that detokenize(tokenize(text)) is the text)."""
    vocab = tokenizer.vocab_size
    bad = next((i for i in r.tokens if i >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                             "tokens")
    return {"prompt": tokenizer.decode(r.tokens, skip_special_tokens=False)}
