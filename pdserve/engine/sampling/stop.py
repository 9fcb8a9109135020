"""When a request stops, and which of its text is safe to stream.

This module owns the per-request stop rules (EOS, stop token ids, stop strings,
max_tokens, min_tokens) and the hold-back buffer that keeps a partial stop
string out of the stream. It sees token ids and already-detokenized text
deltas; detokenization is someone else's job.

The rules come in two halves run in two places: ``token_decision`` (EOS, stop
token ids, max_tokens) is what the engine applies in its step loop to free a
finished request's blocks; ``push`` adds stop strings and the text rules, and runs
outside the step loop (``engine/output.py``: the router, ``LLMEngine.generate``),
given the engine's decision for each token so that both halves agree.

Contract of ``StopChecker.push(token_id, text_delta, num_output_tokens)``, called
once per generated token in order (``num_output_tokens`` counts this token):

* Returns ``(text, decision)``. ``text`` is safe to emit now; ``decision`` is
  None while generation continues. Once a decision is returned, generation is
  over, ``text`` already contains everything left to emit (the held-back tail
  included), and further ``push`` calls raise ``RuntimeError``.
* Stop conditions are inactive while ``num_output_tokens <= min_tokens`` (the
  sampler masks EOS/stop ids over the same tokens). While inactive no text is
  held back and no stop string is matched, so a stop string only matches text
  of tokens after the first ``min_tokens``. ``max_tokens`` always applies (so
  ``min_tokens == max_tokens`` gives exactly that many tokens).
* Active, in priority order on one token:
  1. ``token_id`` in ``stop_token_ids``, or in ``eos_token_ids`` unless
     ``ignore_eos`` -> ``"stop"`` (``stop_reason`` = the token id for a stop
     token, None for EOS). The held-back tail is emitted; this token's own
     ``text_delta`` is emitted only if ``include_stop_str_in_output``.
  2. a stop string in (held-back tail + ``text_delta``) -> ``"stop"``
     (``stop_reason`` = that string). So the first token that completes any stop
     string ends generation; among the strings complete at that token the
     earliest-starting wins (the longest on a tie). Text before it is emitted, the
     string itself only if ``include_stop_str_in_output``, anything after it never.
  3. ``num_output_tokens >= max_tokens`` -> ``"length"``, everything emitted.
  So a stop on the last allowed token reports ``"stop"``, not ``"length"``.
* Otherwise the longest suffix of (tail + delta) that is a proper prefix of some
  stop string (at most ``max(len(stop)) - 1`` chars) is held back and the rest
  returned. Hence the stream never contains part of a stop string that later
  completes.
* ``flush()`` returns (and clears) the held-back tail; call it when generation
  ends for a reason the checker did not decide (abort, model length limit).
* ``push(..., decided=d)`` takes the token-level decision ``d`` (the engine's
  ``token_decision`` for this token, None = it goes on) instead of computing it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pdserve.engine.sampling.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopDecision:
    """Why generation ended (OpenAI ``finish_reason`` plus vLLM-style ``stop_reason``)."""

    finish_reason: FinishReason
    # The matched stop string or stop token id; None for EOS and for "length".
    stop_reason: str | int | None = None


_OWN = object()  # push(): compute the token-level decision here


class StopChecker:
    """Incremental stop detection for one request; see the module docstring."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
        self._params = params
        self._eos = frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = params.stop
        self._tail = ""  # held-back text: a proper prefix of some stop string
        self._decision: StopDecision | None = None

    @property
    def decision(self) -> StopDecision | None:
        """The final decision once made, else None."""
        return self._decision

    def token_decision(self, token_id: int, num_output_tokens: int) -> StopDecision | None:
        """The token-level rules for this token (the engine's half): a stop token id
        or EOS once past ``min_tokens`` -> "stop"; the last allowed token -> "length"."""
        p = self._params
        if num_output_tokens > p.min_tokens:
            if token_id in self._stop_ids:
                return StopDecision("stop", token_id)
            if token_id in self._eos and not p.ignore_eos:
                return StopDecision("stop", None)
        if num_output_tokens >= p.max_tokens:
            return StopDecision("length")
        return None

    def push(
        self, token_id: int, text_delta: str, num_output_tokens: int,
        decided: StopDecision | object | None = _OWN,
    ) -> tuple[str, StopDecision | None]:
        if self._decision is not None:
            raise RuntimeError(f"push after generation stopped ({self._decision})")
        if num_output_tokens < 1:
            raise ValueError(
                f"num_output_tokens counts this token, must be >= 1, got {num_output_tokens}"
            )
        token = self.token_decision(token_id, num_output_tokens) if decided is _OWN else decided
        assert token is None or isinstance(token, StopDecision)
        p = self._params
        if token is not None and token.finish_reason == "stop":  # a stop id or EOS
            own = text_delta if p.include_stop_str_in_output else ""
            return self._finish(self.flush() + own, token)
        if num_output_tokens <= p.min_tokens:
            # Stops are inactive; the tail is empty because nothing was held back yet.
            return (text_delta, None) if token is None else self._finish(text_delta, token)

        pending = self._tail + text_delta
        self._tail = ""
        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            end = start + len(stop) if p.include_stop_str_in_output else start
            return self._finish(pending[:end], StopDecision("stop", stop))

        if token is not None:  # "length"
            return self._finish(pending, token)

        hold = self._partial_suffix_len(pending)
        self._tail = pending[len(pending) - hold :]
        return pending[: len(pending) - hold], None

    def flush(self) -> str:
        """Return and clear the held-back tail (for ends the checker did not decide)."""
        tail, self._tail = self._tail, ""
        return tail

    def _finish(self, text: str, decision: StopDecision) -> tuple[str, StopDecision]:
        self._decision = decision
        self._tail = ""
        return text, decision

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest (start, stop string) in ``text``; the longer string on a tie."""
        best: tuple[int, str] | None = None
        for s in self._stops:
            at = text.find(s)
            if at < 0:
                continue
            if best is None or at < best[0] or (at == best[0] and len(s) > len(best[1])):
                best = (at, s)
        return best

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not self._stops:
            return 0
        longest = max(len(s) for s in self._stops) - 1
        for n in range(min(longest, len(text)), 0, -1):
            suffix = text[-n:]
            if any(len(s) > n and s.startswith(suffix) for s in self._stops):
                return n
        return 0
