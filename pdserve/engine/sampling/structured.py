"""Structured outputs: what a request's tokens must match, as one frozen value.

This module owns ``StructuredOutput`` (a JSON schema, a regex, a list of choices or a
context-free grammar) and turns it into the grammar text of llguidance, the grammar
engine pdserve uses (why llguidance: ``docs/structured-outputs.md``). It does not
import torch: the router checks a request's constraint here before anything reaches
a worker, so a schema the engine cannot compile is a 400 naming its part.
``engine/sampling/grammar.py`` runs the grammar per request (matcher, token masks).

JSON is generated compact with one space after ``:`` and ``,`` (OpenAI's own shape), so
a sampled stream cannot wander off into unbounded whitespace; and an object schema that
lists ``properties`` without saying ``additionalProperties`` gets no others
(``closed_objects``; OpenAI's strict mode, and vLLM's default with xgrammar): a small
model otherwise invents keys until ``max_tokens``. Say ``"additionalProperties": true``
to allow them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema/grammar text larger than 1 MiB is refused
MAX_CHOICES = 4096
# JSON compiler options: compact separators, no free whitespace (see module doc).
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output.

    * ``json``: ``spec`` is a JSON schema as JSON text (``{"type": "object"}`` is what
      ``response_format: json_object`` means);
    * ``regex``: ``spec`` is a regular expression (Rust ``regex`` syntax) the whole
      output matches;
    * ``choice``: ``spec`` is a JSON list of strings; the output is one of them;
    * ``grammar``: ``spec`` is a Lark grammar (llguidance's dialect) or a GBNF one
      (llama.cpp's, the form vLLM's ``guided_grammar`` takes);
    * ``structural_tag`` (vLLM's): ``spec`` is JSON ``{"structures": [{"begin", "schema",
      "end"}, ...], "triggers": [...]}``: free text, but where a trigger is written the
      text goes on with one structure's ``begin``, JSON valid for its ``schema``, then
      its ``end`` (tool calls inside prose; llguidance's ``StructTag``).
    """

    kind: Kind
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got "
                             f"{type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output spec has {len(self.spec)} characters; "
                             f"at most {MAX_SPEC_CHARS}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool) -> StructuredOutput:
        if not isinstance(schema, (Mapping, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex constraint must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
            raise ValueError("a choice constraint must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"a choice constraint allows at most {MAX_CHOICES} strings")
        for c in choices:
            if not isinstance(c, str) or not c:
                raise ValueError(f"choices must be non-empty strings, got {c!r}")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar constraint must be a non-empty string")
        return cls("grammar", text)

    @classmethod
    def structural_tag(cls, spec: Mapping[str, Any]) -> StructuredOutput:
        """vLLM's structural tag: ``structures`` (each ``begin``, ``schema``, ``end``)
        and the ``triggers`` each ``begin`` starts with."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"a structural tag must be an object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - {"structures", "triggers", "type"})
        if unknown:
            raise ValueError(f"a structural tag takes structures and triggers, not "
                             f"{', '.join(unknown)}")
        triggers, structures = spec.get("triggers"), spec.get("structures")
        if (not isinstance(triggers, list) or not triggers
                or not all(isinstance(t, str) and t for t in triggers)):
            raise ValueError("structural tag triggers must be a non-empty list of strings")
        if not isinstance(structures, list) or not structures:
            raise ValueError("structural tag structures must be a non-empty list")
        for i, st in enumerate(structures):
            if (not isinstance(st, Mapping) or set(st) != {"begin", "schema", "end"}
                    or not isinstance(st["begin"], str) or not isinstance(st["end"], str)
                    or not isinstance(st["schema"], (Mapping, bool))):
                raise ValueError(f"structures[{i}] must have exactly begin and end (strings) "
                                 "and schema (a JSON schema)")
            if not any(st["begin"].startswith(t) for t in triggers):
                raise ValueError(f"structures[{i}].begin {st['begin']!r} starts with none of "
                                 "the triggers")
        return cls("structural_tag", json.dumps({"structures": structures,
                                                 "triggers": triggers}))

    def describe(self) -> str:
        """Short, loggable name of the constraint (never the whole schema)."""
        return f"{self.kind}({len(self.spec)} chars)"


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains",
            "propertyNames", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that
    lists ``properties`` and says nothing of other properties (``allOf`` members are
    left open: closing each would refuse the others' properties)."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {k: closed_objects(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed_objects(v) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed_objects(v, closable=False) for v in value]
        elif key in _SCHEMAS:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if (closable and isinstance(schema.get("properties"), Mapping)
            and not {"additionalProperties", "patternProperties",
                     "unevaluatedProperties"} & schema.keys()):
        out["additionalProperties"] = False
    return out


def _compile(s: StructuredOutput, special_triggers: bool) -> str:
    if s.kind == "structural_tag":
        spec = json.loads(s.spec)
        tags = [llguidance.StructTag(
            trigger=next(t for t in spec["triggers"] if st["begin"].startswith(t)),
            begin=st["begin"], end=st["end"],
            # the same JSON as a json constraint's: compact, closed objects
            grammar=({**closed_objects(st["schema"]), "x-guidance": JSON_OPTIONS}
                     if isinstance(st["schema"], Mapping) else st["schema"]))
            for st in spec["structures"]]
        try:
            return str(llguidance.StructTag.to_grammar(tags, assume_special=special_triggers))
        except ValueError as exc:
            raise ValueError(f"invalid structural_tag constraint: {exc}") from exc
    if s.kind == "json":
        try:
            schema = closed_objects(json.loads(s.spec))
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                     defaults=JSON_OPTIONS))
        except ValueError as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from exc
    try:
        return str(llguidance.grammar_from(s.kind, s.spec))
    except ValueError as exc:
        raise ValueError(f"invalid {s.kind} constraint: {exc}") from exc


class _Cache:
    """Grammar texts of recently used constraints, checked once (an LRU)."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._items: OrderedDict[tuple[StructuredOutput, bool], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, s: StructuredOutput, special_triggers: bool) -> str:
        key = (s, special_triggers)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        grammar = _compile(s, special_triggers)
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits())
        if error:
            raise ValueError(f"invalid {'JSON schema' if s.kind == 'json' else s.kind} "
                             f"constraint: {error}")
        with self._lock:
            self._items[key] = grammar
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return grammar


_CACHE = _Cache()


def grammar_of(s: StructuredOutput, special_triggers: bool = False) -> str:
    """llguidance grammar text for ``s``, checked (``ValueError`` naming what is wrong);
    cached, so a schema every request repeats is compiled once per process.
    ``special_triggers``: a structural tag's ``<...>`` triggers are the vocabulary's
    special tokens (``tag_triggers``), not text."""
    return _CACHE.get(s, special_triggers)


def tag_triggers(s: StructuredOutput) -> list[str]:
    """A structural tag's triggers written ``<...>``: a model may have them as special
    tokens (``<tool_call>``), which llguidance matches as tokens, not text."""
    if s.kind != "structural_tag":
        return []
    return [t for t in json.loads(s.spec)["triggers"] if t.startswith("<") and t.endswith(">")]


def limits() -> llguidance.LLParserLimits:
    """Bounds on the work one grammar may cost (llguidance's fuel units; its defaults,
    stated here): a pathological schema fails to compile within these, with an error,
    instead of holding a worker. Errors do not echo the grammar (it may be private)."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
        max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)
