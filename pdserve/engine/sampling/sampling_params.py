"""Per-request sampling parameters: one frozen, validated dataclass.

This module owns the user-facing knobs that decide how a request's tokens are
chosen (``sampler.py``) and when generation ends (``stop.py``). Every value is
checked once in ``__post_init__``; a bad value raises ``ValueError`` naming the
field and its allowed range, so the API layer can turn it into a 400 response.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling.structured import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one token's bias
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_BAD_WORDS = 128  # token sequences (a word is tokenized with and without a space)
MAX_BAD_WORD_TEXTS = MAX_BAD_WORDS // 2  # words a request gives as text
MAX_BAD_WORD_TOKENS = 64
AGING_S = 1.0  # priority aging: every second of waiting is worth one priority level
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Range:
    """The values one numeric field allows: ``RANGES`` is the one table both
    ``SamplingParams`` (every API's check) and the HTTP request models (their pydantic
    bounds and published JSON schema) read."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed
    hi_open: bool = False
    text: str = ""  # how an error states it; "" = from the bounds

    def holds(self, value: float) -> bool:
        """Inside the range (NaN never is)."""
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def describe(self) -> str:
        """``in [0, 1]``, ``in (0, 1]``, ``>= -1``, ``> 0``, or ``text``."""
        if self.text:
            return self.text
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{self.lo:g}, "
                    f"{self.hi:g}{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"

    def bounds(self) -> dict[str, Any]:
        """As pydantic ``Field`` keywords (``ge``/``gt``, ``le``/``lt``)."""
        out: dict[str, Any] = {}
        if self.lo is not None:
            out["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            out["lt" if self.hi_open else "le"] = self.hi
        return out


_INT64 = "in the int64 range [-2**63, 2**63-1]"
# Checked in this order after max_tokens and min_tokens (min_tokens <= max_tokens is a
# rule between fields, not a range). None (an optional field unset) is never checked.
RANGES: dict[str, Range] = {
    "temperature": Range(0.0, MAX_TEMPERATURE, text=f"in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, text=">= -1 (0 or -1 = disabled)"),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, lo_open=True),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "seed": Range(INT64_MIN, INT64_MAX, text=_INT64),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
    "priority": Range(INT64_MIN, INT64_MAX, text=_INT64),
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    Semantics (the sampler and stop checker implement exactly these):

    * ``temperature == 0`` is greedy (argmax after penalties and min_tokens masking).
    * ``top_k`` of 0 or -1 disables top-k; ``top_p == 1`` and ``min_p == 0`` disable theirs.
    * ``repetition_penalty`` (HF/vLLM): for every token present in prompt + output,
      a positive logit is divided by it and a negative one multiplied by it.
    * ``frequency_penalty`` / ``presence_penalty`` (OpenAI): over output tokens only,
      ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
    * ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, and no stop
      condition fires, until that many tokens have been generated.
    * ``ignore_eos``: the engine does not stop on EOS; EOS may still be sampled.
    * ``logprobs``: report the top-N logprobs (N in 0..20) of every sampled token,
      from the raw model distribution; 0 reports only the sampled token's logprob.
    * ``prompt_logprobs``: the same for every prompt token after the first (the
      first has no context to be predicted from); such a request bypasses the
      prefix cache so that every prompt position is computed. With it,
      ``max_tokens`` may be 0: score the prompt, generate nothing.
    * ``stop`` / ``stop_token_ids``: also accept a list (stored as a tuple); ``stop``
      also accepts one string. The stop string is cut from the output unless
      ``include_stop_str_in_output``.
    * ``logit_bias`` (OpenAI): token id -> bias in [-100, 100], added to the logit
      before anything else (a mapping is accepted and stored as sorted pairs).
    * ``allowed_token_ids`` (vLLM's): when not empty, only these tokens can be
      sampled (every other logit is -inf, after the bias).
    * ``bad_words`` (vLLM's, tokenized): token sequences the output must not contain.
      The last token of a sequence is masked wherever the output so far ends with the
      rest of it (a one-token sequence is masked always). The output alone is looked
      at, as in vLLM: a sequence that would start in the prompt is not caught.
    * ``cache_salt`` (vLLM's): the request's prompt blocks are hashed under this salt,
      so only requests with the same salt share them in the prefix cache (a tenant's
      prompts cannot be probed by another's timings); None shares with every
      unsalted request.
    * ``skip_special_tokens``: the output text leaves special tokens out (the
      default) or writes them (``<|im_end|>``); the tokens themselves are the same.
    * ``structured``: the output must match this JSON schema / regex / choice /
      grammar; tokens that cannot continue a match are masked after the penalties.
    * ``resumed_tokens``: the last N prompt tokens are output an earlier attempt of this
      request already produced (a retry on another worker): a grammar continues after
      them. The router sets it; clients do not.
    * ``prediction`` (OpenAI's predicted outputs, tokenized): what the output is
      expected to be, e.g. a file being edited. A decoding engine drafts from it
      (``spec_decode.PredictionProposer``) and verifies as any speculation: the output
      is the one without it, token for token; a good prediction only makes it faster.
    * ``priority`` (vLLM's field): lower runs first, in the router's admission queue and
      in each worker's waiting queue (with aging, so a low priority never starves). It
      rides here so that every hop that carries the request carries it.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    resumed_tokens: int = 0
    priority: int = 0
    prediction: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    skip_special_tokens: bool = True
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Types first (normalising ints/floats/lists), then ranges.
        self._set("max_tokens", _as_int("max_tokens", self.max_tokens))
        self._set("min_tokens", _as_int("min_tokens", self.min_tokens))
        self._set("top_k", _as_int("top_k", self.top_k))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            self._set(name, _as_float(name, getattr(self, name)))
        if self.seed is not None:
            self._set("seed", _as_int("seed", self.seed))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._set(name, _as_int(name, getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {_tname(getattr(self, name))}")
        self._set("stop", _as_stop(self.stop))
        self._set("stop_token_ids", _as_token_ids("stop_token_ids", self.stop_token_ids))
        self._set("prediction", _as_token_ids("prediction", self.prediction))
        self._set("logit_bias", _as_logit_bias(self.logit_bias))
        self._set("allowed_token_ids",
                  tuple(sorted(set(_as_token_ids("allowed_token_ids", self.allowed_token_ids)))))
        self._set("bad_words", _as_bad_words(self.bad_words))
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got "
                             f"{self.cache_salt!r}")
        self._set("resumed_tokens", _as_int("resumed_tokens", self.resumed_tokens))
        self._set("priority", _as_int("priority", self.priority))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got "
                             f"{_tname(self.structured)}")

        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be >= 1 (0 only with prompt_logprobs), "
                             f"got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None and not allowed.holds(value):
                raise ValueError(f"{name} must be {allowed.describe()}, got {value}")
        if self.resumed_tokens < 0:
            raise ValueError(f"resumed_tokens must be >= 0, got {self.resumed_tokens}")

    def _set(self, name: str, value: object) -> None:
        # Frozen dataclass: normalisation in __post_init__ has to bypass __setattr__.
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any repetition/frequency/presence penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def needs_processing(self) -> bool:
        """True when the logits are changed before the draw (bias, grammar, penalties)."""
        return (self.has_penalties or bool(self.logit_bias) or self.structured is not None
                or bool(self.allowed_token_ids) or bool(self.bad_words))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping (e.g. request JSON); unknown keys are errors naming them."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be a mapping, got {_tname(d)}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in d if k not in allowed]
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(repr(k) for k in unknown)}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
        return cls(**d)


def request_problem(prompt_token_ids: Sequence[int], params: SamplingParams, vocab: int,
                    max_model_len: int) -> tuple[str, str] | None:
    """Why a request can never be served by a model of ``vocab`` tokens and a context
    of ``max_model_len`` and the field at fault (``prompt``, ``max_tokens``, ...), or
    None. The one copy of these rules: the router refuses a request with it before
    routing (400), the engine again on intake (``ValueError``)."""
    n = len(prompt_token_ids)
    if n == 0:
        return "prompt is empty", "prompt"
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        return f"prompt token ids must be in [0, {vocab})", "prompt"
    if n >= max_model_len:
        return f"prompt has {n} tokens; the model's context is {max_model_len} tokens", "prompt"
    if n + params.max_tokens > max_model_len:
        return (f"{params.max_tokens} new tokens cannot fit: the prompt ({n}) and they exceed "
                f"the context of {max_model_len} tokens (at most {max_model_len - n} new "
                "tokens)", "max_tokens")
    if any(t >= vocab for t in params.stop_token_ids):
        return f"stop_token_ids must be < vocab size {vocab}", "stop_token_ids"
    if any(t >= vocab for t, _ in params.logit_bias):
        return f"logit_bias token ids must be < vocab size {vocab}", "logit_bias"
    if any(t >= vocab for t in params.allowed_token_ids):
        return f"allowed_token_ids must be < vocab size {vocab}", "allowed_token_ids"
    if any(t >= vocab for word in params.bad_words for t in word):
        return f"bad_words token ids must be < vocab size {vocab}", "bad_words"
    if any(t >= vocab for t in params.prediction):
        return f"prediction token ids must be < vocab size {vocab}", "prediction"
    if params.resumed_tokens >= n:
        return (f"resumed_tokens ({params.resumed_tokens}) must be shorter than the "
                f"prompt ({n})", "prompt")
    return None


def effective_priority(priority: int, waited_s: float, aging_s: float = AGING_S) -> int:
    """``priority`` less one level per ``aging_s`` seconds waited (lower runs first): the
    one ordering rule of the router's admission queue and each engine's waiting queue."""
    return priority - math.floor(max(0.0, waited_s) / aging_s)


def _tname(value: object) -> str:
    return type(value).__name__


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass; True as max_tokens is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {_tname(value)} {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_tname(value)} {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    return result


def _as_stop(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {_tname(value)}")
    for s in value:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {_tname(s)} {s!r}")
        if not s:
            raise ValueError("stop strings must be non-empty")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    return tuple(value)


def _as_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping (token id, or its decimal string as JSON keys are) -> bias, or pairs."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in items):
            raise ValueError("logit_bias must map token ids to numbers")
    else:
        raise ValueError(f"logit_bias must map token ids to numbers, got {_tname(value)}")
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias allows at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                         f"got {len(items)}")
    out: dict[int, float] = {}
    for key, bias in items:
        if isinstance(key, str):
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            key = int(key)
        tid = _as_int("logit_bias token id", key)
        if tid < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {tid}")
        b = _as_float(f"logit_bias[{tid}]", bias)
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{tid}] must be in [-100, 100], got {b:g}")
        out[tid] = b
    return tuple(sorted(out.items()))


def _as_bad_words(value: object) -> tuple[tuple[int, ...], ...]:
    """Token id sequences, each non-empty; duplicates dropped, order kept."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"bad_words must be a list of token id lists, got {_tname(value)}")
    words = tuple(dict.fromkeys(_as_token_ids("bad_words", w) for w in value))
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words allows at most {MAX_BAD_WORDS} token sequences, "
                         f"got {len(words)}")
    for w in words:
        if not 0 < len(w) <= MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words sequences must have 1 to {MAX_BAD_WORD_TOKENS} "
                             f"tokens, got {len(w)}")
    return words


def _as_token_ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {_tname(value)}")
    ids = tuple(_as_int(f"{name} element", t) for t in value)
    for t in ids:
        if t < 0:
            raise ValueError(f"{name} must be non-negative, got {t}")
    return ids
