"""The gRPC messages (``protos/pdserve/v1/pdserve.proto``) mapped to the router's
front-boundary types (``router/types.py``): a proto request -> ``GenerateRequest``
(sampling parameters validated by ``SamplingParams``), a router stream item -> a
``GenerateResponse``.

Sampling parameters beyond the scalar ones: ``logit_bias`` (a map), ``priority``,
vLLM's token controls (``allowed_token_ids``, ``skip_special_tokens``, ``cache_salt``;
on the request ``bad_words`` and ``truncate_prompt_tokens``), and the ``structured``
oneof (``json_schema`` as JSON text, ``json_object``, ``regex``, ``choice``,
``grammar``, ``structural_tag`` as JSON text) -> ``StructuredOutput``, compiled
before the request runs (``check_structured``: ``api.common.compile_constraints``, at
most ``STRUCTURED_COMPILE_TIMEOUT_S``).

A chat prompt takes vLLM's chat extras (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` as JSON text), checked by the same
rule as HTTP's (``openai.chat_messages.ChatTemplateFields.template_args``).

The request's ``prediction`` oneof (OpenAI's predicted outputs): text, which the router
tokenizes, or token ids -> ``params.prediction``; ``Usage`` then carries the drafted
prediction tokens accepted and rejected.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.protos import pb
from pdserve.router.api.common import (
    ConstraintRefused,
    checked_request_id,
    compile_constraints,
    one_line,
)
from pdserve.router.openai.chat_messages import ChatTemplateFields
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk

# SamplingParameters fields that are proto3 `optional`: copied only when set, so
# SamplingParams' own defaults apply otherwise (max_tokens 16 is not proto's 0).
_OPTIONAL_PARAMS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logprobs",
    "skip_special_tokens",
    "cache_salt",
)
# StageTimings fields sent as `<name>_s` (tpot is derived, sent too).
_TIMING_FIELDS = (
    "router_queue",
    "prefill_queue",
    "prefill",
    "kv_transfer",
    "decode_queue",
    "ttft",
    "e2e",
)


def sampling_params_from_proto(params: Any) -> SamplingParams:
    """``pb.SamplingParameters`` -> validated ``SamplingParams``; ValueError names the field.

    The structured-output constraint is built but not compiled here (see
    ``check_structured``)."""
    kwargs: dict[str, Any] = {
        name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)
    }
    return SamplingParams(
        **kwargs,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=tuple(params.logit_bias.items()),  # validated and sorted there
        priority=params.priority,
        structured=structured_from_proto(params),
        allowed_token_ids=tuple(params.allowed_token_ids),
    )


def structured_from_proto(params: Any) -> StructuredOutput | None:
    """The ``structured`` oneof -> ``StructuredOutput`` (None: unset, or json_object
    false); ValueError names the field."""
    kind = params.WhichOneof("structured")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None
    try:
        if kind in ("json_schema", "structural_tag"):
            try:
                spec = json.loads(getattr(params, kind), parse_constant=_no_constant)
            except ValueError as exc:  # JSONDecodeError, and numbers past Python's limits
                raise ValueError(f"not valid JSON: {exc}") from None
            return (StructuredOutput.json_schema(spec) if kind == "json_schema"
                    else StructuredOutput.structural_tag(spec))
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "regex":
            return StructuredOutput.regex(params.regex)
        if kind == "choice":
            return StructuredOutput.choice(list(params.choice.choices))
        return StructuredOutput.grammar(params.grammar)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise ValueError(f"{kind}: {one_line(str(exc))}") from None


def _json_object(field: str, text: str) -> dict[str, Any] | None:
    """A JSON object given as text (empty: None); ValueError naming ``field``."""
    if not text:
        return None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{field}: not valid JSON: {one_line(str(exc))}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def structured_field(params: Any) -> str:
    """The name of the ``structured`` oneof's field that is set (errors name it)."""
    return params.WhichOneof("structured") or "structured"


async def check_structured(req: GenerateRequest, field: str) -> None:
    """Compile ``req.params.structured`` (``api.common.compile_constraints``); ValueError
    naming ``field`` if it is invalid or too slow to compile."""
    structured = req.params.structured
    if structured is None:
        return
    try:
        await compile_constraints([(field, structured)])
    except ConstraintRefused as exc:
        if exc.limit_s is None:
            raise ValueError(str(exc)) from None
        raise ValueError(f"{field}: the constraint took longer than {exc.limit_s:g} s to "
                         f"compile; simplify it") from None


def request_from_proto(request: Any, time_remaining: float | None) -> GenerateRequest:
    """``pb.GenerateRequest`` -> ``GenerateRequest``; ValueError on bad input.

    The deadline is the earlier of the request's ``timeout_s`` and the gRPC deadline.
    """
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is required: set one of text, chat, token_ids")
    req = GenerateRequest(
        request_id=checked_request_id(request.request_id or None),
        params=sampling_params_from_proto(request.params),
        timeout_s=request.timeout_s if request.HasField("timeout_s") else None,
    )
    if kind == "text":
        req.prompt = request.text
    elif kind == "chat":
        req.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    else:
        req.prompt_token_ids = list(request.token_ids.ids)
    template = [f for f, given in (
        ("add_generation_prompt", request.HasField("add_generation_prompt")),
        ("continue_final_message", request.continue_final_message),
        ("chat_template_kwargs", bool(request.chat_template_kwargs))) if given]
    if template:
        if kind != "chat":
            raise ValueError(f"{template[0]} needs a chat prompt")
        req.chat_template_args = ChatTemplateFields(
            add_generation_prompt=(request.add_generation_prompt
                                   if request.HasField("add_generation_prompt") else True),
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=_json_object("chat_template_kwargs",
                                              request.chat_template_kwargs)).template_args()
    predicted = request.WhichOneof("prediction")
    if predicted == "prediction_text":
        req.prediction = request.prediction_text
    elif predicted == "prediction_token_ids":
        req.params = replace(req.params, prediction=tuple(request.prediction_token_ids.ids))
    if request.HasField("truncate_prompt_tokens"):
        req.truncate_prompt_tokens = request.truncate_prompt_tokens
    req.bad_words = tuple(request.bad_words)
    if (problem := req.problem()) is not None:  # the router's rules, before the deadline
        raise ValueError(problem[1])
    if time_remaining is not None:  # the gRPC deadline, when earlier (past: ends at once)
        left = max(time_remaining, 1e-6)
        req.timeout_s = min(req.timeout_s or left, left)
    return req


def _prediction_usage(counts: tuple[int, int] | None) -> dict[str, int]:
    if counts is None:
        return {}
    return {"accepted_prediction_tokens": counts[0], "rejected_prediction_tokens": counts[1]}


def response_from_item(item: StreamChunk | FinalChunk) -> Any:
    """A router stream item -> ``pb.GenerateResponse``."""
    if isinstance(item, StreamChunk):
        logprobs = [
            pb.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in item.logprobs
        ]
        chunk = pb.TokenChunk(token_ids=item.token_ids, text=item.text, logprobs=logprobs)
        return pb.GenerateResponse(chunk=chunk)
    timings: dict[str, float | str | None] = {
        f"{name}_s": getattr(item.timings, name) for name in _TIMING_FIELDS}
    timings["tpot_s"] = item.timings.tpot
    timings["placement"] = item.timings.placement
    timings["placement_reason"] = item.timings.placement_reason
    final = pb.Final(
        finish_reason=item.finish_reason,
        usage=pb.Usage(
            prompt_tokens=item.usage.prompt_tokens,
            completion_tokens=item.usage.completion_tokens,
            cached_tokens=item.usage.cached_tokens,
            **_prediction_usage(item.usage.prediction_tokens),
        ),
        timings=pb.StageTimings(**{k: v for k, v in timings.items() if v is not None},
                                spec_draft_tokens=item.timings.spec_draft_tokens,
                                spec_accepted_tokens=item.timings.spec_accepted_tokens),
        num_retries=item.num_retries,
    )
    if isinstance(item.stop_reason, str):
        final.stop_string = item.stop_reason
    elif isinstance(item.stop_reason, int):
        final.stop_token_id = item.stop_reason
    return pb.GenerateResponse(final=final)
