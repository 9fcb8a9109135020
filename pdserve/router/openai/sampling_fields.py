"""The fields both completions bodies share (``SamplingFields``) and how they map
to the router's request: ``sampling_params`` (the ``SamplingParams``), the output
constraints they set, beam search's limits; a body's ``n`` choices as router requests
(``choice_requests``), and the constraints compiled before the request runs
(``check_grammars``). Each body (``completion_request``, ``chat_request``) maps itself
with these.

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
  call syntax, ``tool_parsers``) each become ``SamplingParams.structured``; at most one
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
from typing import Annotated, Any

from pydantic import Field

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.router.api.beam_search import MAX_BEAM_WIDTH
from pdserve.router.api.common import ConstraintRefused, compile_constraints, one_line
from pdserve.router.openai.request_models import (
    MAX_N,
    Choices,
    GenerationFields,
    InvalidRequest,
    JsonObjectFormat,
    JsonSchema,
    JsonSchemaFormat,
    NonEmpty,
    ResponseFormat,
    StreamOptions,
    StructuralTagFormat,
    StructuredOutputs,
    TopN,
)
from pdserve.router.openai.tool_parsers.base import ToolSyntax
from pdserve.router.types import GenerateRequest

INT64 = 2**63
Named = list[tuple[str, StructuredOutput]]  # (field or its part, constraint)


@dataclass
class Plan:
    """What the API layer does around a body's router request: the constraints that
    must compile before it runs, and how its output is read."""

    grammars: Named  # (field, constraint): check_grammars
    tools: ToolSyntax | None = None  # chat: the output's tool calls are in this syntax


def field_of(name: str) -> str:
    """The request field a part's name is in (``tools[0].function.parameters`` -> tools)."""
    return name.split(".", 1)[0].split("[", 1)[0]


def constraint(name: str, make: Callable[[Any], StructuredOutput], arg: Any,
               ) -> tuple[str, StructuredOutput]:
    try:
        return name, make(arg)
    except ValueError as exc:
        raise InvalidRequest(f"{name}: {one_line(str(exc))}", field_of(name)) from exc


def _json_constraint(schema: JsonSchema | str) -> StructuredOutput:
    """A schema, or its JSON text (vLLM takes both)."""
    return StructuredOutput.json_schema(json.loads(schema) if isinstance(schema, str) else schema)


def _structural_tag(spec: dict[str, Any] | str) -> StructuredOutput:
    """A structural tag, or its JSON text (vLLM's fields take text)."""
    return StructuredOutput.structural_tag(json.loads(spec) if isinstance(spec, str) else spec)


class SamplingFields(GenerationFields):
    """Fields both completions endpoints share; vLLM's output constraints at the end."""

    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | str | None = None  # a schema, or its JSON text
    guided_regex: NonEmpty | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmpty | None = None  # Lark (llguidance) or GBNF
    structured_outputs: StructuredOutputs | None = None
    structural_tag: NonEmpty | None = None  # vLLM's older field: JSON text, as above
    # vLLM's: each prompt token's logprob and its top-N (not streamed)
    prompt_logprobs: TopN | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text
    return_token_ids: bool = False
    # vLLM's beam search: n beams (the width), scored cum_logprob / len ** length_penalty
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(ge=-10.0, le=10.0)] = 1.0

    def output_constraints(self) -> Named:
        """Every output constraint the body sets, named by the field that sets it."""
        fmt = self.response_format
        so = self.structured_outputs or StructuredOutputs()
        out = []
        if isinstance(fmt, JsonObjectFormat) or (isinstance(fmt, JsonSchemaFormat)
                                                 and fmt.json_schema.schema_ is None):
            out.append(("response_format", StructuredOutput.json_object()))
        elif isinstance(fmt, JsonSchemaFormat):
            out.append(constraint("response_format", StructuredOutput.json_schema,
                                  fmt.json_schema.schema_))
        elif isinstance(fmt, StructuralTagFormat):
            out.append(constraint("response_format", _structural_tag,
                                  fmt.model_dump(exclude={"type"})))
        if so.json_object:
            out.append(("structured_outputs.json_object", StructuredOutput.json_object()))
        given: list[tuple[str, Callable[[Any], StructuredOutput], Any]] = [
            ("guided_json", _json_constraint, self.guided_json),
            ("guided_regex", StructuredOutput.regex, self.guided_regex),
            ("guided_choice", StructuredOutput.choice, self.guided_choice),
            ("guided_grammar", StructuredOutput.grammar, self.guided_grammar),
            ("structured_outputs.json", _json_constraint, so.json_),
            ("structured_outputs.regex", StructuredOutput.regex, so.regex),
            ("structured_outputs.choice", StructuredOutput.choice, so.choice),
            ("structured_outputs.grammar", StructuredOutput.grammar, so.grammar),
            ("structured_outputs.structural_tag", _structural_tag, so.structural_tag),
            ("structural_tag", _structural_tag, self.structural_tag)]
        out += [constraint(name, make, arg) for name, make, arg in given if arg is not None]
        return out

    def check_beam_search(self, params: SamplingParams, constraints: Named,
                          refused: Sequence[tuple[str, bool]] = ()) -> None:
        """InvalidRequest (param ``use_beam_search``) saying the first field beam
        search would ignore (it draws nothing and stops at EOS or ``max_tokens`` only:
        temperature, top-p/k/min-p and the seed are moot, anything else that shapes the
        output is refused rather than ignored)."""
        if not self.use_beam_search:
            return
        if self.stream:
            raise InvalidRequest("beam search answers whole: stream must be false with "
                                 "use_beam_search", "use_beam_search")
        if (self.n or 1) > MAX_BEAM_WIDTH:
            raise InvalidRequest(f"use_beam_search takes n (its width) up to {MAX_BEAM_WIDTH}",
                                 "use_beam_search")
        ignored = [name for name, used in (
            ("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
            ("min_tokens", params.min_tokens > 0), ("logit_bias", bool(params.logit_bias)),
            ("repetition_penalty", params.repetition_penalty != 1.0),
            ("frequency_penalty", params.frequency_penalty != 0.0),
            ("presence_penalty", params.presence_penalty != 0.0),
            ("allowed_token_ids", bool(params.allowed_token_ids)),
            ("bad_words", bool(self.bad_words)),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            *refused, *((name, True) for name, _ in constraints[:1])) if used]
        if ignored:
            raise InvalidRequest(f"{ignored[0]} is not supported with use_beam_search",
                                 "use_beam_search")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        aliases: Mapping[str, str], prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The ``SamplingParams`` these fields ask for, with the limit, logprobs and
        constraint the body's own fields make (``aliases``: the body's name of a
        ``SamplingParams`` field named in an error)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true",
                                 "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs is not available when streaming (as in "
                                 "vLLM)", "prompt_logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
        try:
            return SamplingParams(
                **extra, min_tokens=self.min_tokens, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty, seed=self.seed, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                prompt_logprobs=prompt_logprobs,
                logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
                structured=structured, priority=self.priority,
                allowed_token_ids=tuple(self.allowed_token_ids or ()),
                skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            )
        except ValueError as exc:
            # SamplingParams' messages start with the field's name.
            first = str(exc).split(" ", 1)[0]
            raise InvalidRequest(str(exc), aliases.get(first, first)) from exc


def only_one(constraints: Named) -> StructuredOutput | None:
    """The request's one output constraint (None: none); InvalidRequest for two."""
    if len(constraints) > 1:
        (a, _), (b, _) = constraints[:2]
        raise InvalidRequest(f"at most one output constraint per request: {a} and {b} were "
                             "both given", field_of(b))
    return constraints[0][1] if constraints else None


async def check_grammars(grammars: Named) -> None:
    """InvalidRequest naming the field unless every constraint compiles, all within
    ``api.common.STRUCTURED_COMPILE_TIMEOUT_S`` (``compile_constraints``)."""
    try:
        await compile_constraints(grammars)
    except ConstraintRefused as exc:
        message = (exc.message if exc.limit_s is None
                   else f"schema too complex to compile within {exc.limit_s:g} s")
        raise InvalidRequest(f"{exc.name}: {message}", field_of(exc.name)) from None


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
