"""Structured outputs, logit bias and token bans (allowed_token_ids, bad_words) in the
engine: every sampled token obeys the request's grammar, the grammar follows the
request across the prefill -> decode hand-off, a retry (``resumed_tokens``) and
preemption, constrained rows leave their neighbours' tokens alone, and bad constraints
are refused with a clear error."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput, grammar_of
from tests.engine.handoff import decode_to_end, disaggregate

# Schemas of our own: nested objects, arrays with bounds, enums, patterns, numbers with
# ranges, optional fields, anyOf and $defs. (Integers: a random-weight model would write
# the digits of an unbounded fraction until max_tokens.)
SCHEMAS: list[dict] = [
    {"type": "object",
     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                             "minItems": 1, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object",
     "properties": {"point": {"type": "object",
                              "properties": {"x": {"type": "integer", "minimum": -10,
                                                   "maximum": 10},
                                             "y": {"type": "integer", "exclusiveMinimum": 0,
                                                   "maximum": 500}},
                              "required": ["x", "y"], "additionalProperties": False},
                    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "ok": {"type": "boolean"}},
     "required": ["point", "code", "ok"], "additionalProperties": False},
    {"$defs": {"item": {"type": "object",
                        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                       "kind": {"anyOf": [{"const": "book"},
                                                          {"type": "null"}]}},
                        "required": ["id", "kind"], "additionalProperties": False}},
     "type": "object",
     "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                              "minItems": 2, "maxItems": 2},
                    "note": {"type": "string", "maxLength": 8}},
     "required": ["items"], "additionalProperties": False},
]


def engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{"num_blocks": 256, **kw}))  # type: ignore[arg-type]


def structured(schema: dict, **kw: object) -> SamplingParams:
    return SamplingParams(structured=StructuredOutput.json_schema(schema), **kw)  # type: ignore[arg-type]


def test_json_schemas_always_validate_at_temperature(tiny_model: Callable[[str], Path]) -> None:
    """A random-weight model obeys every schema: the grammar, not the model, decides."""
    eng = engine(tiny_model("llama-gqa"))
    prompts = ["Write JSON:"] * 12
    params = [structured(SCHEMAS[i % 3], max_tokens=160, temperature=0.8, seed=i)
              for i in range(12)]
    for out, p in zip(eng.generate(prompts, params), params, strict=True):
        assert out.finish_reason == "stop", out.text
        assert p.structured is not None
        jsonschema.validate(json.loads(out.text), json.loads(p.structured.spec))
    eng.check_integrity()


def test_regex_choice_and_grammar(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    regex = SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                           structured=StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,4}"))
    choice = SamplingParams(max_tokens=40, temperature=1.0, seed=4,
                            structured=StructuredOutput.choice(["alpha", "beta gamma"]))
    gbnf = SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                          structured=StructuredOutput.grammar('root ::= "yes" | "no" | "maybe"'))
    lark = SamplingParams(max_tokens=40, temperature=1.0, seed=6,
                          structured=StructuredOutput.grammar('start: "(" NUM ")"\n'
                                                              'NUM: /[1-9][0-9]?/'))
    r, c, g, lk = eng.generate(["a"] * 4, [regex, choice, gbnf, lark])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.text), r.text
    assert c.text in ("alpha", "beta gamma")
    assert g.text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([1-9][0-9]?\)", lk.text), lk.text


def test_constrained_rows_leave_neighbours_alone(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    plain = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)
    alone = eng.generate(["The quick brown fox"], plain)[0].token_ids
    mixed = eng.generate(["The quick brown fox", "x", "y"],
                         [plain, structured(SCHEMAS[0], max_tokens=60, temperature=0.8, seed=1),
                          SamplingParams(max_tokens=10, logit_bias={5: 100.0})])
    assert mixed[0].token_ids == alone


def test_logit_bias_forces_and_bans(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    base = eng.generate(["hello"], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    forced = eng.generate(["hello"], SamplingParams(max_tokens=6, ignore_eos=True,
                                                    logit_bias={"77": 100}))[0].token_ids
    assert forced == [77] * 6
    banned = eng.generate(["hello"], SamplingParams(max_tokens=6, ignore_eos=True,
                                                    logit_bias={base[0]: -100}))[0].token_ids
    assert banned[0] != base[0]
    # Sampled rows too: +100 puts all the mass on one token.
    sampled = eng.generate(["hello"], SamplingParams(max_tokens=6, ignore_eos=True,
                                                     temperature=1.0, seed=2,
                                                     logit_bias={"77": 100}))[0].token_ids
    assert sampled == [77] * 6


WEATHER_TAG = {"structures": [{"begin": "<function=get_weather>", "end": "</function>",
                               "schema": {"type": "object", "properties": {
                                   "city": {"type": "string", "maxLength": 8}},
                                   "required": ["city"]}}],
               "triggers": ["<function="]}


def test_a_structural_tag_constrains_what_follows_its_trigger(
        tiny_model: Callable[[str], Path]) -> None:
    """Free text until a trigger; then the structure's JSON and its end. The output
    begins after a trigger (an earlier attempt's, ``resumed_tokens``), so the model
    must write the call's JSON."""
    eng = engine(tiny_model("llama-gqa"))
    tag = StructuredOutput.structural_tag(WEATHER_TAG)
    said = eng.tokenizer.encode("Sure. <function=get_weather>", add_special_tokens=False)
    for seed in range(3):
        out = eng.generate([[5, 6, *said]], SamplingParams(
            max_tokens=60, temperature=0.9, seed=seed, structured=tag,
            resumed_tokens=len(said)))[0]
        call, sep, _ = out.text.partition("</function>")
        assert sep and set(json.loads(call)) == {"city"}, out.text
    # A call the structure does not allow is refused where it is (a retry's tokens).
    bad = eng.tokenizer.encode("Sure. <function=get_weather>hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="do not match"):
        eng.add_request("bad", [5, 6, *bad], SamplingParams(structured=tag,
                                                            resumed_tokens=len(bad)))
    free = eng.generate([[5, 6]], SamplingParams(max_tokens=20, structured=tag))[0]
    assert "<function=" not in free.text or "</function>" in free.text
    # A trigger written <...>: the vocabulary's special token where it is one
    # (<|im_start|> in the tiny model's), else text (<tool_call>).
    for trigger in ("<tool_call>", "<|im_start|>"):
        spec = {"structures": [{**WEATHER_TAG["structures"][0], "begin": trigger,
                                "end": "."}], "triggers": [trigger]}
        said = eng.tokenizer.encode(f"Sure. {trigger}", add_special_tokens=False)
        out = eng.generate([[5, 6, *said]], SamplingParams(
            max_tokens=60, temperature=0.9, seed=1, resumed_tokens=len(said),
            structured=StructuredOutput.structural_tag(spec)))[0]
        call, sep, _ = out.text.partition("}.")
        assert sep and set(json.loads(call + "}")) == {"city"}, (trigger, out.text)


def test_allowed_token_ids_and_bad_words(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    base = eng.generate(["hello"], free)[0].token_ids
    allowed = (base[0], 40, 41, 77)
    for p in (replace(free, allowed_token_ids=allowed),
              replace(free, allowed_token_ids=allowed, temperature=1.0, seed=3)):
        out = eng.generate(["hello"], p)[0].token_ids
        assert set(out) <= set(allowed), out
    # A pair the free output writes: banned, the output follows the free one up to its
    # second token and writes the pair nowhere.
    pair = (base[4], base[5])
    out = eng.generate(["hello"], replace(free, bad_words=[pair]))[0].token_ids
    assert out[:5] == base[:5] and out[5] != base[5]
    assert all((a, b) != pair for a, b in itertools.pairwise(out))
    # One token: banned from the first (the prefill side samples it)
    prefill, decode = engine(tiny_model("llama-gqa")), engine(tiny_model("llama-gqa"), role="decode")
    prompt = eng.tokenizer.encode("hello")
    one = replace(free, bad_words=[(base[0],), pair])
    first = disaggregate(prefill, decode, "r", prompt, one)
    rest, _ = decode_to_end(decode)
    assert [first, *rest] == eng.generate([prompt], one)[0].token_ids
    assert base[0] not in [first, *rest]


def test_special_tokens_are_written_when_asked(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    im_end = eng.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1
    forced = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={im_end[0]: 100})
    skipped, written = eng.generate(["hi", "hi"], [
        forced, replace(forced, skip_special_tokens=False)])
    assert skipped.token_ids == written.token_ids == im_end * 3
    assert skipped.text == "" and written.text == "<|im_end|>" * 3


def test_retry_resumes_the_grammar(tiny_model: Callable[[str], Path]) -> None:
    """A retry prefills prompt + the tokens already sent and continues the same JSON."""
    eng = engine(tiny_model("llama-gqa"))
    p = structured(SCHEMAS[1], max_tokens=120)
    prompt = eng.tokenizer.encode("Write JSON:")
    whole = eng.generate([prompt], p)[0]
    k = 7
    again = eng.generate([prompt + whole.token_ids[:k]],
                         structured(SCHEMAS[1], max_tokens=120 - k, resumed_tokens=k))[0]
    assert whole.token_ids[:k] + again.token_ids == whole.token_ids
    # Seeded sampling resumes its random stream too.
    sampled = structured(SCHEMAS[0], max_tokens=100, temperature=0.9, seed=5)
    whole = eng.generate([prompt], sampled)[0]
    again = eng.generate([prompt + whole.token_ids[:k]],
                         structured(SCHEMAS[0], max_tokens=100 - k, temperature=0.9, seed=5,
                                    resumed_tokens=k))[0]
    assert whole.token_ids[:k] + again.token_ids == whole.token_ids
    # Without resuming, the grammar would start over inside the JSON: a different text.
    fresh = eng.generate([prompt + whole.token_ids[:k]], structured(SCHEMAS[1], max_tokens=113))
    assert fresh[0].token_ids != again.token_ids


def test_a_retry_resumes_penalties_and_bans(tiny_model: Callable[[str], Path]) -> None:
    """Frequency and presence penalties and bad words count an earlier attempt's output
    (``resumed_tokens``) as output: the retried stream is the uninterrupted one."""
    eng = engine(tiny_model("llama-gqa"))
    prompt = eng.tokenizer.encode("hello")
    free = eng.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    p = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=3,
                       frequency_penalty=1.5, presence_penalty=0.5,
                       bad_words=[(free[8], free[9]), (free[15], free[16])])
    whole = eng.generate([prompt], p)[0].token_ids
    for k in (5, 9, 16):
        again = eng.generate([prompt + whole[:k]], replace(
            p, max_tokens=30 - k, resumed_tokens=k))[0].token_ids
        assert whole[:k] + again == whole, k


def test_grammar_follows_the_handoff(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    p = structured(SCHEMAS[0], max_tokens=100, temperature=0.7, seed=11)
    colocated = engine(path).generate(["Write JSON:"], p)[0]
    prefill, decode = engine(path, role="prefill"), engine(path, role="decode")
    prompt = prefill.tokenizer.encode("Write JSON:")
    tokens = [disaggregate(prefill, decode, "r", prompt, p)]
    while decode.has_unfinished():
        for o in decode.step().outputs:
            tokens.extend(o.new_token_ids)
    assert tokens == colocated.token_ids


def test_preempted_constrained_requests_stay_valid(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    params = [structured(SCHEMAS[i % 3], max_tokens=120, temperature=0.8, seed=i)
              for i in range(6)]
    roomy = engine(path).generate(["Write JSON:"] * 6, params)
    tight = engine(path, num_blocks=10)
    squeezed = tight.generate(["Write JSON:"] * 6, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    tight.check_integrity()


def test_min_tokens_yields_to_a_finished_grammar(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    out = eng.generate(["a"], SamplingParams(max_tokens=20, min_tokens=10,
                                             structured=StructuredOutput.choice(["yes"])))[0]
    assert out.text == "yes"


def test_bad_constraints_are_refused(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    with pytest.raises(ValueError, match="Invalid type: wat"):
        eng.add_request("a", "x", structured({"type": "wat"}))
    with pytest.raises(ValueError, match="unclosed group"):
        eng.add_request("b", "x", SamplingParams(structured=StructuredOutput.regex("a(b")))
    with pytest.raises(ValueError, match="logit_bias token ids must be < vocab"):
        eng.add_request("c", "x", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match=r"in \[-100, 100\]"):
        SamplingParams(logit_bias={"5": 101})
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={"five": 1})
    # The decode side refuses a first token its grammar does not allow.
    decode = engine(tiny_model("llama-gqa"), role="decode")
    p = SamplingParams(structured=StructuredOutput.choice(["yes"]))
    prompt = decode.tokenizer.encode("x")
    assert decode.reserve("d", prompt, p) is not None
    bad = decode.tokenizer.encode("no", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match="does not match its structured output"):
        decode.start_decode("d", bad)
    decode.abort("d")
    assert eng.generate(["x"], SamplingParams(max_tokens=2))[0].finish_reason is not None
    eng.check_integrity()
    decode.check_integrity()


def test_a_text_only_engine_refuses_grammars(tiny_model: Callable[[str], Path]) -> None:
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64), load_tokenizer=False)
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        eng.add_request("a", [5, 6, 7], SamplingParams(structured=StructuredOutput.choice(["a"])))


def test_schema_compiles_once() -> None:
    s = StructuredOutput.json_schema(SCHEMAS[2])
    assert grammar_of(s) is grammar_of(StructuredOutput.json_schema(SCHEMAS[2]))


def test_objects_without_a_word_on_other_keys_are_closed() -> None:
    from pdserve.engine.sampling.structured import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object", "properties": {}, "additionalProperties": True},
        "properties": {"type": "array", "items": {"properties": {"y": {}}}}},
        "allOf": [{"properties": {"z": {}}}],
        "$defs": {"D": {"properties": {"w": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert closed["properties"]["properties"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]  # a property
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert schema["properties"]["a"] == {"type": "object", "properties": {"x": {"type": "integer"}}}


def test_bitmask_kernel_equals_reference() -> None:
    import torch

    from pdserve.engine import kernels
    from pdserve.engine.sampling.grammar import apply_bitmask, apply_bitmask_reference

    if not kernels.available():
        pytest.skip(f"no CPU kernels here: {kernels.reason()}")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    for words in (32, 30):  # covering the vocabulary, and short of it (the rest is -inf)
        mask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=g)
        mask[0], mask[1] = 0, -1  # nothing allowed; everything allowed
        fast, ref = logits.clone(), logits.clone()
        apply_bitmask(fast, [5, 0, 2, 3], mask)
        apply_bitmask_reference(ref, [5, 0, 2, 3], mask)
        assert torch.equal(fast, ref)
        assert torch.equal(fast[[1, 4]], logits[[1, 4]])  # rows not listed are untouched
