"""``OutputProcessor``: one request's text, made outside the engine's step loop.

The engine streams token ids and decides the token-level stops (EOS, stop token ids,
max_tokens: ``StopChecker.token_decision``), which free the request's blocks at once.
This object turns those ids into text deltas (``IncrementalDetokenizer``: never half a
UTF-8 character) and applies stop strings with their hold-back (``StopChecker.push``
given the engine's decision for each token), so the two halves of the rules always
agree. It runs where the text is needed: in the router, once per request for its
whole life (a retry on another worker pair continues the same processor, so text and
held-back stop-string prefixes carry over exactly), and in ``LLMEngine.generate``.

A stop string ends generation where the engine did not: the caller aborts the
request in the engine (the router: on the worker). Tokens after it in the same push
are not part of the output (``Processed.num_tokens`` says how many are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.stop import StopChecker, StopDecision
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class Processed(NamedTuple):
    text: str  # safe to stream now
    decision: StopDecision | None  # set once generation is over
    num_tokens: int  # tokens of the push that belong to the output


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                              params.skip_special_tokens)
                       if tokenizer is not None else None)
        # The engine's decisions are passed in, so the checker needs no EOS ids.
        self._stop = StopChecker(params, ())
        self.num_output_tokens = 0
        self.decision: StopDecision | None = None

    def push(self, token_ids: Sequence[int], engine_decision: StopDecision | None) -> Processed:
        """Text of the next output tokens; ``engine_decision`` is the engine's
        token-level decision for the last of them (None: it goes on)."""
        if self.decision is not None:
            raise RuntimeError(f"push after generation stopped ({self.decision})")
        pieces: list[str] = []
        last = len(token_ids) - 1
        for i, token in enumerate(token_ids):
            self.num_output_tokens += 1
            delta = self._detok.push(token) if self._detok is not None else ""
            text, decision = self._stop.push(token, delta, self.num_output_tokens,
                                             decided=engine_decision if i == last else None)
            pieces.append(text)
            if decision is not None:
                if self._detok is not None and not isinstance(decision.stop_reason, str):
                    # Bytes of an unfinished character come out as U+FFFD, as in a
                    # full decode; after a stop string nothing more is emitted.
                    pieces.append(self._detok.finish())
                self.decision = decision
                return Processed("".join(pieces), decision, i + 1)
        return Processed("".join(pieces), None, len(token_ids))

    def flush(self) -> str:
        """The held-back text, when generation ends for another reason (abort)."""
        return self._stop.flush()
