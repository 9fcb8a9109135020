"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) mapped to
``GenerateRequest``s (one per choice), with the output constraint (structured
outputs, forced tool calls) and the tool-call syntax the response is read with. The
bodies' pydantic models and the fields we refuse are ``openai.request_models.py``.

Rules:

* Types are strict (``"5"`` is not an int, ``true`` is not 1); ints are accepted
  where a number is expected. Every problem is an ``InvalidRequest`` naming the
  field, which the HTTP layer turns into a 400.
* Value ranges live in the models (``Field`` bounds, the same as
  ``SamplingParams``'), so the JSON schema that ``http.openapi_doc`` publishes states
  them; only rules between fields (``min_tokens <= max_tokens``, ``stream_options``
  needs ``stream``, ``top_logprobs`` needs ``logprobs``, ``max_tokens`` 0 needs
  ``echo``, ``best_of`` equals ``n``, one output constraint per request,
  ``tool_choice`` needs ``tools`` and names one of them, content needed unless the
  role is assistant), whether a schema, regex or grammar compiles (``check_grammars``,
  bounded by ``api.common.STRUCTURED_COMPILE_TIMEOUT_S``) and limits of the model (context,
  vocabulary) are not in it.
* Output constraints: ``response_format`` (``json_object``, ``json_schema``, vLLM's
  ``structural_tag``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar``, its ``structural_tag`` and its ``structured_outputs`` object, and
  ``tool_choice`` ``required`` or a named function (a grammar of the model family's
  call syntax, ``tool_calls``) each become ``SamplingParams.structured``; at most one
  per request.
* Tools: declared tools reach the chat template as a system prompt in the model
  family's syntax, earlier calls and tool results as text in it (``chat_messages``).
* ``n`` choices are ``n`` router requests ``{id}-{i}`` of one prompt; with a ``seed``,
  choice i uses ``seed + i``. A completions batch of prompts is a request per prompt
  (``{id}-{p}``, then its choices), choice ``p * n + i`` (vLLM's order); a prompt's
  choices are seeded the same whatever the batch, so batching changes no answer.
* Fields we cannot honour (``suffix``, legacy ``functions``, audio, ...) are refused
  unless they carry their harmless default; each `Refused` rule carries the JSON
  schema of its harmless values beside its test. Other unknown fields (``user``,
  ``metadata``, ``store``, ...) are tolerated and ignored, as OpenAI clients send
  many of them.
* vLLM's token controls: ``allowed_token_ids``, ``skip_special_tokens`` and
  ``cache_salt`` go to ``SamplingParams`` as they are; ``bad_words`` (text) and
  ``truncate_prompt_tokens`` ride on the ``GenerateRequest`` to the router, which
  tokenizes the prompt and the words.
* Defaults follow OpenAI: ``temperature`` 1, ``max_tokens`` 16 for completions and
  "until the context is full" for chat.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import (
    SamplingParams,
)
from pdserve.engine.structured import StructuredOutput
from pdserve.router.api.beam_search import MAX_BEAM_WIDTH
from pdserve.router.api.common import ConstraintRefused, compile_constraints, one_line
from pdserve.router.openai.request_models import (
    INT64,
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    CompletionRequest,
    InvalidRequest,
    JsonObjectFormat,
    JsonSchema,
    JsonSchemaFormat,
    Named,
    NamedToolChoice,
    SamplingFields,
    StructuralTagFormat,
    StructuredOutputs,
    validate_body,
)
from pdserve.router.openai.tool_parsers.base import ToolSyntax
from pdserve.router.types import GenerateRequest


@dataclass
class Plan:
    """What the API layer does around a body's router request: the constraints that
    must compile before it runs, and how its output is read."""

    grammars: Named  # (field, constraint): check_grammars
    tools: ToolSyntax | None = None  # chat: the output's tool calls are in this syntax


def _field(name: str) -> str:
    """The request field a part's name is in (``tools[0].function.parameters`` -> tools)."""
    return name.split(".", 1)[0].split("[", 1)[0]


def _constraint(name: str, make: Callable[[Any], StructuredOutput], arg: Any,
                ) -> tuple[str, StructuredOutput]:
    try:
        return name, make(arg)
    except ValueError as exc:
        raise InvalidRequest(f"{name}: {one_line(str(exc))}", _field(name)) from exc


def _json_constraint(schema: JsonSchema | str) -> StructuredOutput:
    """A schema, or its JSON text (vLLM takes both)."""
    return StructuredOutput.json_schema(json.loads(schema) if isinstance(schema, str) else schema)


def _structural_tag(spec: dict[str, Any] | str) -> StructuredOutput:
    """A structural tag, or its JSON text (vLLM's fields take text)."""
    return StructuredOutput.structural_tag(json.loads(spec) if isinstance(spec, str) else spec)


def _output_constraints(r: SamplingFields) -> Named:
    """Every output constraint the body sets, named by the field that sets it."""
    fmt = r.response_format
    so = r.structured_outputs or StructuredOutputs()
    out = []
    if isinstance(fmt, JsonObjectFormat) or (isinstance(fmt, JsonSchemaFormat)
                                             and fmt.json_schema.schema_ is None):
        out.append(("response_format", StructuredOutput.json_object()))
    elif isinstance(fmt, JsonSchemaFormat):
        out.append(_constraint("response_format", StructuredOutput.json_schema,
                               fmt.json_schema.schema_))
    elif isinstance(fmt, StructuralTagFormat):
        out.append(_constraint("response_format", _structural_tag,
                               fmt.model_dump(exclude={"type"})))
    if so.json_object:
        out.append(("structured_outputs.json_object", StructuredOutput.json_object()))
    given: list[tuple[str, Callable[[Any], StructuredOutput], Any]] = [
        ("guided_json", _json_constraint, r.guided_json),
        ("guided_regex", StructuredOutput.regex, r.guided_regex),
        ("guided_choice", StructuredOutput.choice, r.guided_choice),
        ("guided_grammar", StructuredOutput.grammar, r.guided_grammar),
        ("structured_outputs.json", _json_constraint, so.json_),
        ("structured_outputs.regex", StructuredOutput.regex, so.regex),
        ("structured_outputs.choice", StructuredOutput.choice, so.choice),
        ("structured_outputs.grammar", StructuredOutput.grammar, so.grammar),
        ("structured_outputs.structural_tag", _structural_tag, so.structural_tag),
        ("structural_tag", _structural_tag, r.structural_tag)]
    out += [_constraint(name, make, arg) for name, make, arg in given if arg is not None]
    return out


def _check_beam_search(r: SamplingFields, params: SamplingParams, constraints: Named,
                       refused: Sequence[tuple[str, bool]] = ()) -> None:
    """InvalidRequest (param ``use_beam_search``) saying the first field beam search
    would ignore (it draws nothing and stops at EOS or ``max_tokens`` only: temperature,
    top-p/k/min-p and the seed are moot, anything else that shapes the output is
    refused rather than ignored)."""
    if not r.use_beam_search:
        return
    if r.stream:
        raise InvalidRequest("beam search answers whole: stream must be false with "
                             "use_beam_search", "use_beam_search")
    if (r.n or 1) > MAX_BEAM_WIDTH:
        raise InvalidRequest(f"use_beam_search takes n (its width) up to {MAX_BEAM_WIDTH}",
                             "use_beam_search")
    ignored = [name for name, used in (
        ("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
        ("min_tokens", params.min_tokens > 0), ("logit_bias", bool(params.logit_bias)),
        ("repetition_penalty", params.repetition_penalty != 1.0),
        ("frequency_penalty", params.frequency_penalty != 0.0),
        ("presence_penalty", params.presence_penalty != 0.0),
        ("allowed_token_ids", bool(params.allowed_token_ids)),
        ("bad_words", bool(r.bad_words)), ("prompt_logprobs", r.prompt_logprobs is not None),
        *refused, *((name, True) for name, _ in constraints[:1])) if used]
    if ignored:
        raise InvalidRequest(f"{ignored[0]} is not supported with use_beam_search",
                             "use_beam_search")


def _only_one(constraints: Named) -> StructuredOutput | None:
    if len(constraints) > 1:
        (a, _), (b, _) = constraints[:2]
        raise InvalidRequest(f"at most one output constraint per request: {a} and {b} were "
                             "both given", _field(b))
    return constraints[0][1] if constraints else None


async def check_grammars(grammars: Named) -> None:
    """InvalidRequest naming the field unless every constraint compiles, all within
    ``api.common.STRUCTURED_COMPILE_TIMEOUT_S`` (``compile_constraints``)."""
    try:
        await compile_constraints(grammars)
    except ConstraintRefused as exc:
        message = (exc.message if exc.limit_s is None
                   else f"schema too complex to compile within {exc.limit_s:g} s")
        raise InvalidRequest(f"{exc.name}: {message}", _field(exc.name)) from None


def choice_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The router requests of ``n`` choices of ``req``'s prompt: ``req`` itself when n is
    1, else ids ``{id}-{i}``, choice i seeded ``seed + i`` (wrapping within int64) when
    the request has a seed; choices 1.. are routed to where choice 0's prompt is cached
    (``share_prefix``)."""
    if n == 1:
        return [req]
    seed = req.params.seed
    return [dataclasses.replace(req, request_id=f"{req.request_id}-{i}", share_prefix=i > 0,
                                params=dataclasses.replace(req.params, seed=None if seed is None
                                                           else (seed + i + INT64) % (2 * INT64)
                                                           - INT64))
            for i in range(n)]


def _params(r: SamplingFields, max_tokens: int | None, logprobs: int | None,
            aliases: Mapping[str, str], prompt_logprobs: int | None = None,
            structured: StructuredOutput | None = None) -> SamplingParams:
    if r.stream_options is not None and not r.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true",
                             "stream_options")
    if r.prompt_logprobs is not None and r.stream:
        raise InvalidRequest("prompt_logprobs is not available when streaming (as in vLLM)",
                             "prompt_logprobs")
    stop = [r.stop] if isinstance(r.stop, str) else (r.stop or [])
    extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
    try:
        return SamplingParams(
            **extra, min_tokens=r.min_tokens, temperature=r.temperature, top_p=r.top_p,
            top_k=r.top_k, min_p=r.min_p, repetition_penalty=r.repetition_penalty,
            frequency_penalty=r.frequency_penalty, presence_penalty=r.presence_penalty,
            seed=r.seed, stop=tuple(stop), stop_token_ids=tuple(r.stop_token_ids or ()),
            ignore_eos=r.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=r.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            logit_bias=tuple((int(t), b) for t, b in (r.logit_bias or {}).items()),
            structured=structured, priority=r.priority,
            allowed_token_ids=tuple(r.allowed_token_ids or ()),
            skip_special_tokens=r.skip_special_tokens, cache_salt=r.cache_salt,
        )
    except ValueError as exc:
        # SamplingParams' messages start with the field's name.
        first = str(exc).split(" ", 1)[0]
        raise InvalidRequest(str(exc), aliases.get(first, first)) from exc


def completion_request(body: Any, request_id: str,
                       ) -> tuple[CompletionRequest, list[GenerateRequest], Plan]:
    """A ``/v1/completions`` body -> (parsed body, a router request per prompt, plan);
    InvalidRequest. A batch of prompts: ids ``{id}-{i}``; one prompt: ``{id}``."""
    r: CompletionRequest = validate_body(CompletionRequest, body, REFUSED_COMPLETION)
    if r.max_tokens == 0 and not r.echo and r.prompt_logprobs is None:
        raise InvalidRequest("max_tokens must be >= 1 (0 only with echo or prompt_logprobs: "
                             "the prompt alone)", "max_tokens")
    if r.best_of is not None and r.best_of != (r.n or 1):
        raise InvalidRequest(f"best_of={r.best_of} must equal n={r.n or 1}: returning the best "
                             "of more candidates than n is not supported", "best_of")
    constraints = _output_constraints(r)
    # echo + logprobs: the prompt's logprobs; max_tokens 0 computes them anyway
    echo_logprobs = (r.logprobs if r.logprobs is not None else 0 if r.max_tokens == 0
                     else None) if r.echo else None
    asked = [n for n in (echo_logprobs, r.prompt_logprobs) if n is not None]
    params = _params(r, r.max_tokens, r.logprobs, {}, max(asked) if asked else None,
                     _only_one(constraints))
    _check_beam_search(r, params, constraints, [("echo", r.echo)])
    batch = isinstance(r.prompt, list) and bool(r.prompt) and isinstance(r.prompt[0], str | list)
    prompts: list[Any] = list(r.prompt) if batch else [r.prompt]
    reqs = []
    for i, prompt in enumerate(prompts):
        req = GenerateRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}", params,
                              timeout_s=r.timeout_s, bad_words=tuple(r.bad_words or ()),
                              truncate_prompt_tokens=r.truncate_prompt_tokens)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids = list(prompt)
        reqs.append(req)
    return r, reqs, Plan(constraints)


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


def _tool_constraints(r: ChatCompletionRequest, syntax: ToolSyntax) -> tuple[bool, Named, Named]:
    """(whether the tools are offered to the model, their parameters schemas, which
    must compile, and for ``required`` or a named function the grammar of the calls)."""
    functions = [t.function for t in r.tools or []]
    choice = r.tool_choice if r.tool_choice is not None else "auto" if functions else "none"
    if choice != "none" and not functions:
        raise InvalidRequest(f"tool_choice={choice!r} needs tools", "tool_choice")
    names = [f.name for f in functions]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise InvalidRequest(f"tools declares function {twice!r} twice", "tools")
    schemas = [_constraint(f"tools[{i}].function.parameters", StructuredOutput.json_schema,
                           f.parameters)
               for i, f in enumerate(functions) if f.parameters is not None]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names function {choice.function.name!r}, which "
                                 "tools does not declare", "tool_choice")
        called, parallel = [f for f in functions if f.name == choice.function.name], False
    elif choice == "required":
        called, parallel = functions, r.parallel_tool_calls
    else:
        return choice == "auto", schemas, []
    grammar = syntax.grammar([f.model_dump(exclude_none=True) for f in called], parallel)
    return True, schemas, [_constraint("tool_choice", StructuredOutput.grammar, grammar)]


def chat_echo(r: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the text the answer's content begins with -- the last
    message's, when its role is the answer's (assistant with ``add_generation_prompt``,
    else the last message's own: the answer continues it)."""
    last = r.messages[-1]
    if not r.echo or (r.add_generation_prompt and last.role != "assistant"):
        return ""
    content = last.content
    return content if isinstance(content, str) else "".join(p.text for p in content or [])


def chat_template_args(r: ChatTemplateFields) -> dict[str, Any]:
    """The chat extras as ``Tokenizer.apply_chat_template``'s keywords; InvalidRequest
    for a pair it cannot take (what only rendering finds, e.g. an empty final message
    to continue, is the prompt's error then)."""
    if r.continue_final_message and r.add_generation_prompt:
        raise InvalidRequest("continue_final_message=true needs add_generation_prompt=false "
                             "(the answer continues the final message, not a new turn)",
                             "continue_final_message")
    kwargs = r.chat_template_kwargs or {}
    taken = sorted({"messages", "tools", "add_generation_prompt", "documents"} & kwargs.keys())
    if taken:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)} (the "
                             "request's own fields set them)", "chat_template_kwargs")
    if r.documents is not None:
        kwargs = {**kwargs, "documents": r.documents}
    return {"add_generation_prompt": r.add_generation_prompt,
            "continue_final_message": r.continue_final_message, "template_kwargs": kwargs}


def chat_request(body: Any, request_id: str,
                 prompt_len: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None,
                                       dict[str, Any]], int],
                 max_model_len: int, syntax: ToolSyntax, native_tools: bool = False,
                 ) -> tuple[ChatCompletionRequest, GenerateRequest, Plan]:
    """A ``/v1/chat/completions`` body -> (parsed body, router request, plan);
    InvalidRequest. ``syntax``: the model family's tool calls (``tool_calls.syntax_for``);
    ``native_tools``: the chat template renders tools itself (``Tokenizer.renders_tools``).

    ``prompt_len(messages, tools, chat_template_args)`` tokenizes with the chat
    template; it is called only when the client set no token limit (the default is the
    rest of the context).
    """
    r: ChatCompletionRequest = validate_body(ChatCompletionRequest, body, REFUSED_CHAT)
    offered, schemas, forced = _tool_constraints(r, syntax)
    tools = [t.model_dump(exclude_none=True) for t in r.tools or []] if offered else None
    messages = chat_messages(r.messages, syntax, tools, native_tools)
    template_tools = tools if native_tools else None
    template = chat_template_args(r)
    if r.top_logprobs is not None and not r.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    constraints = _output_constraints(r) + forced
    structured = _only_one(constraints)
    logprobs = (r.top_logprobs or 0) if r.logprobs else None
    limit_name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    if max_tokens is None:
        try:
            n = prompt_len(messages, template_tools, template)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "messages") from exc
        if r.truncate_prompt_tokens is not None and r.truncate_prompt_tokens > 0:
            n = min(n, r.truncate_prompt_tokens)
        # a too-long prompt gets the router's 400, or is cut to max_model_len - 1 (-1)
        max_tokens = max(1, max_model_len - n)
    params = _params(r, max_tokens, logprobs,
                     {"max_tokens": limit_name, "logprobs": "top_logprobs"},
                     r.prompt_logprobs, structured)
    _check_beam_search(r, params, constraints, [("prediction", r.prediction is not None)])
    return r, GenerateRequest(request_id, params, messages=messages, timeout_s=r.timeout_s,
                              tools=template_tools, chat_template_args=template,
                              prediction=None if r.prediction is None else r.prediction.text,
                              bad_words=tuple(r.bad_words or ()),
                              truncate_prompt_tokens=r.truncate_prompt_tokens), \
        Plan(schemas + constraints, syntax if offered else None)
