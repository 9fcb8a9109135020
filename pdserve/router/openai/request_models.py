"""What every OpenAI request body shares: the pydantic base (``Body``: strict types)
and field types, the generation fields of every generate endpoint, the 400 they raise
(``InvalidRequest``), the fields we refuse (each ``Refused`` rule with the JSON schema
of its harmless values, which ``http.openapi_doc`` publishes) and the one rule by
which a route reads its body (``validate_body``). Each endpoint's body is its own
module (``completion_request``, ``chat_request``, ``responses.request``, ``tokenize``);
``sampling_fields`` has the rules the completions bodies follow."""

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.engine.sampling.sampling_params import (
    MAX_BAD_WORD_TEXTS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRINGS,
    RANGES,
)
from pdserve.engine.sampling.structured import MAX_CHOICES

log = logging.getLogger("pdserve.router")

MAX_N = 16  # choices per prompt
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]


def _in(name: str) -> Any:
    """The bounds of sampling field ``name``: SamplingParams' own (one table for both,
    ``sampling_params.RANGES``), so gRPC and HTTP refuse the same values."""
    return Field(**RANGES[name].bounds())


TopN = Annotated[int, _in("logprobs")]
NonEmpty = Annotated[str, Field(min_length=1)]
JsonSchema = dict[str, Any]
Choices = Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_CHOICES)]
# token id (in decimal, as JSON keys are strings) -> bias
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
         Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(max_length=MAX_LOGIT_BIAS_TOKENS, json_schema_extra={"additionalProperties": False})]


class InvalidRequest(ValueError):
    """A 400: ``param`` is the request field at fault (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaSpec(Body):
    name: NonEmpty
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")  # None: any object
    strict: bool | None = None


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuralTagFormat(Body):
    """vLLM's structural tag: free text, where a trigger starts one of the structures
    (``begin``, JSON for its ``schema``, ``end``); ``StructuredOutput.structural_tag``."""

    type: Literal["structural_tag"]
    structures: Annotated[list[dict[str, Any]], Field(min_length=1)]
    triggers: Annotated[list[NonEmpty], Field(min_length=1)]


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat | StructuralTagFormat,
                           Field(discriminator="type")]


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: JsonSchema | str | None = Field(default=None, alias="json")
    regex: NonEmpty | None = None
    choice: Choices | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None
    structural_tag: NonEmpty | None = None  # JSON text: {"structures", "triggers"}


class GenerationFields(Body):
    """Fields every generate endpoint shares (the Responses API's too); the vLLM
    extensions are at the end."""

    model: str | None = None
    stream: bool = False
    temperature: Annotated[float, _in("temperature")] = 1.0
    top_p: Annotated[float, _in("top_p")] = 1.0
    seed: Annotated[int, _in("seed")] | None = None
    logit_bias: LogitBias | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Annotated[float, _in("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, _in("frequency_penalty")] = 0.0
    # vLLM's extensions (OpenAI clients send them through ``extra_body``)
    top_k: Annotated[int, _in("top_k")] = 0
    min_p: Annotated[float, _in("min_p")] = 0.0
    repetition_penalty: Annotated[float, _in("repetition_penalty")] = 1.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    priority: Annotated[int, _in("priority")] = 0  # lower runs first
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    # words the output must not write (each tokenized with and without a leading space)
    bad_words: Annotated[list[NonEmpty], Field(max_length=MAX_BAD_WORD_TEXTS)] | None = None
    skip_special_tokens: bool = True  # false: the text writes them (<|im_end|>)
    # keep the prompt's last N tokens; -1: as many as leave room for max_tokens
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs' tokens read "token_id:{id}"
    # only requests with the same salt share prefix-cached blocks (tenant isolation)
    cache_salt: NonEmpty | None = None
    # pdserve's: deadline in seconds from arrival (as the gRPC field); past it, 504
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None


@dataclass(frozen=True)
class Refused:
    """A field we cannot honour: allowed only with a harmless value. ``harmless``
    tests a value; ``schema`` is the JSON schema of the same values (for the
    OpenAPI document), kept beside the test so the two cannot drift apart."""

    harmless: Callable[[Any], bool]
    schema: dict[str, Any]
    why: str = ""  # said after "... is not supported by this server"


def only(*values: Any) -> Refused:
    # `x in (None, 1)` would accept True (== 1): compare types too.
    return Refused(lambda v: any(v == h and type(v) is type(h) for h in values),
                   {"enum": list(values)})


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict | str) and not value)


EMPTY = Refused(_is_empty, {"anyOf": [
    {"type": "null"}, {"type": "object", "maxProperties": 0}, {"type": "array", "maxItems": 0},
    {"type": "string", "maxLength": 0}]})
# vLLM's extensions that this server does not implement: their defaults (what a
# client that sends every field sends) are taken, anything else is refused rather
# than ignored -- an ignored logits_processors or vllm_xargs would answer as if it
# had been applied.
VLLM_UNIMPLEMENTED: dict[str, Refused] = {
    "spaces_between_special_tokens": only(None, True),
    "logits_processors": EMPTY,
    "guided_whitespace_pattern": only(None),
    "kv_transfer_params": EMPTY,  # this server moves the KV itself
    "vllm_xargs": EMPTY,
}
# a request's own chat template: the model's is used
OWN_TEMPLATE = Refused(EMPTY.harmless, EMPTY.schema, "the model's own chat template is used")

# Fields OpenAI's clients send that cannot change this server's answers (its models
# do not reason, it stores no chat completions, it has one service tier): accepted and
# logged as ignored, as vLLM does. A route's own field of the same name is its own.
IGNORED_FIELDS = frozenset({
    "store", "service_tier", "metadata", "user", "prompt_cache_key", "safety_identifier",
    "prompt_cache_retention", "reasoning_effort", "reasoning", "verbosity",
    "stream_options",  # /v1/responses: include_obfuscation (chat and completions read it)
})


@functools.cache
def known_fields(model: type[Body]) -> frozenset[str]:
    """The body fields ``model`` reads (by name and by alias)."""
    return frozenset(n for name, f in model.model_fields.items() for n in (name, f.alias) if n)


def validate_body(model: type[Body], body: Any,
                  refused: Mapping[str, Refused] | None = None,
                  besides: frozenset[str] = frozenset()) -> Any:
    """A request body as ``model``, by one rule for every route's top-level fields: a
    field the route reads is validated; one in ``refused`` is accepted only at its
    harmless values; one of ``IGNORED_FIELDS`` is accepted and logged as ignored;
    one of ``besides`` (another route's, a body sent to be counted) is accepted; any
    other is refused, naming it (InvalidRequest)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    refused = refused or {}
    known = known_fields(model)
    unknown = sorted(k for k in body if k not in known and k not in refused
                     and k not in IGNORED_FIELDS and k not in besides)
    if unknown:
        raise InvalidRequest(f"unknown field{'s' * (len(unknown) > 1)} "
                             f"{', '.join(map(repr, unknown))}", unknown[0])
    for name, rule in refused.items():
        if name in body and not rule.harmless(body[name]):
            why = f": {rule.why}" if rule.why else ""
            raise InvalidRequest(f"{name}={body[name]!r} is not supported by this server{why}",
                                 name)
    if ignored := sorted(k for k in body if k in IGNORED_FIELDS and k not in known):
        log.warning("request fields ignored (they cannot change the answer here): %s",
                    ", ".join(ignored))
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3])
        raise InvalidRequest(f"invalid request: {detail}", param) from None
