"""One table of sampling ranges (``sampling_params.RANGES``): the HTTP request models
refuse exactly the values ``SamplingParams`` refuses (what gRPC and the engine check),
at every bound of every field, and publish those bounds in their JSON schema."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.engine.sampling.sampling_params import RANGES, Range, SamplingParams
from pdserve.router.openai.chat_request import ChatCompletionRequest
from pdserve.router.openai.completion_request import CompletionRequest

FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
MODELS = {CompletionRequest: {"prompt": "hi"},
          ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]}}


def edges(r: Range, integer: bool) -> list[tuple[float, bool]]:
    """Values at and just past each bound, with whether the range holds them."""
    step = 1 if integer else 0.5
    out: list[tuple[float, bool]] = []
    if r.lo is not None:
        out += [(r.lo, not r.lo_open), (r.lo - step, False), (r.lo + step, True)]
    if r.hi is not None:
        out += [(r.hi, not r.hi_open), (r.hi + step, False), (r.hi - step, True)]
    return out


def accepts(model: Any, body: dict[str, Any]) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(RANGES))
def test_http_and_sampling_params_refuse_the_same_values(name: str) -> None:
    integer = "int" in str(FIELD_TYPES[name])
    checked = 0
    for value, held in edges(RANGES[name], integer):
        assert RANGES[name].holds(value) is held
        try:
            SamplingParams(**{name: value})
            engine = True
        except ValueError as exc:
            engine = False
            assert str(exc).startswith(f"{name} must be {RANGES[name].describe()}")
        assert engine is held, (name, value)
        for model, base in MODELS.items():
            field = model.model_fields.get(name)
            if field is None or field.annotation is bool:  # chat's logprobs is a flag
                continue
            assert accepts(model, {**base, name: value}) is held, (model.__name__, name, value)
            checked += 1
    assert checked  # the field is an HTTP one too


def test_the_json_schema_publishes_the_tables_bounds() -> None:
    props = CompletionRequest.model_json_schema()["properties"]
    keys = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
    for name, r in RANGES.items():
        schema = props[name]
        schema = next(s for s in schema.get("anyOf", [schema]) if s.get("type") != "null")
        assert {keys[k]: v for k, v in r.bounds().items()} == {
            k: v for k, v in schema.items() if k in keys.values()}, name
