"""The placement rule (``placement.py``, a pure function) wired to the router's live
state: ``Placer`` builds the rule's inputs from the workers' last loads and the
router's own counts, turns a decision into what a decode worker's ``reserve`` is told
(``LocalPrefill``), counts each placement where the next decisions read it (before
the reserve call answers, so concurrent admissions see one another), and makes the
attempt's ``Target``, which learns each path's TTFT error from its first token.

Where a deployment has both decode and colocated workers, ``order`` puts the
policy's first colocated worker ahead of its first decode worker when the rule
predicts it answers sooner within the TPOT target (``placement.colocated_first``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import LocalPrefill, Reservation
from pdserve.router.placement import (
    SHARE_WINDOW_S,
    Decision,
    DecodeSide,
    PrefillSide,
    Slo,
    colocated_first,
    decide,
    learn,
)
from pdserve.router.policies import PrefixIndex, RouteInput
from pdserve.router.workers import WorkerState

log = logging.getLogger("pdserve.router")


@dataclass
class Target:
    """Where one attempt's tokens come from, and where its prompt is computed."""

    worker: WorkerState  # a decode or colocated worker
    reservation: Reservation | None  # decode: the reserved blocks; colocated: None
    prefill: WorkerState | None = None  # decode, not local: the prefill worker chosen
    placement: str = "colocated"  # "local" | "remote" | "colocated" (placement.py)
    reason: str = "colocated"  # why (placement.REASONS)
    decision: Decision | None = None  # decode: what the rule predicted
    uncached: int = 0  # prompt tokens computed for it (local: on the decode worker)
    clock: Callable[[], float] = time.monotonic  # the router's (the simulator's: virtual)
    placed_at: float = field(init=False)
    _learnt: bool = False

    def __post_init__(self) -> None:
        self.placed_at = self.clock()

    def first_token(self) -> None:
        """The attempt's first token came: the rule learns how long its prompt took
        against the prediction, on the worker that computed it (once)."""
        d, self._learnt, learnt = self.decision, True, self._learnt
        if learnt or d is None or self.placement == ("remote" if d.local else "local"):
            return  # (a cached suffix the decode worker took itself: not what was predicted)
        w = self.prefill if self.placement == "remote" else self.worker
        predicted = d.ttft_remote_s if self.placement == "remote" else d.ttft_local_s
        if w is not None and math.isfinite(predicted):
            w.ttft_bias_s = learn(w.ttft_bias_s, predicted, self.clock() - self.placed_at)


@dataclass
class Placing:
    """One decision on its way to a decode worker's ``reserve``."""

    d: WorkerState
    p: WorkerState | None
    decision: Decision
    n: int  # prompt tokens
    local: LocalPrefill  # what the decode worker is told
    claim: _Claim  # counted until the reserve call answers


class Placer:
    def __init__(self, prefix: PrefixIndex, token_prefix: PrefixIndex, block_size: int,
                 local_prefill_max_tokens: int, mode: str, slo: Slo,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # every time this rule reads (the simulator's is virtual)
        self._prefix = prefix  # prefill workers' prompt blocks (the router's index)
        self._token_prefix = token_prefix  # token workers' blocks
        self._block_size = block_size
        self._local_prefill_max_tokens = local_prefill_max_tokens
        self.mode = mode
        self.slo = slo

    def order(self, ranked: list[WorkerState], route: RouteInput, params: SamplingParams,
              pick_prefill: Callable[[WorkerState], WorkerState | None],
              ) -> tuple[list[WorkerState], WorkerState | None]:
        """The policy's token workers in the order to try (module doc), and the
        colocated worker put first for its predicted TTFT, if one was."""
        d = next((w for w in ranked if w.role == "decode"), None)
        c = next((w for w in ranked if w.role == "colocated"), None)
        if d is None or c is None or self.mode != "measured":
            return ranked, None
        pair, _ = self._decide(d, pick_prefill(d), route, params, counted=False)
        first = colocated_first(route.num_prompt_tokens, self._cached(c, route), self._side(c),
                                pair, self.slo)
        lead, other = (c, d) if first else (d, c)
        return [lead, other, *(w for w in ranked if w not in (lead, other))], \
            c if first else None

    def prepare(self, d: WorkerState, p: WorkerState | None, route: RouteInput,
                params: SamplingParams) -> Placing:
        """The decision for decode worker ``d`` (this attempt counted in its
        outstanding requests already), counted until ``placed`` or ``claim.undo``."""
        decision, cached = self._decide(d, p, route, params)
        n = route.num_prompt_tokens
        local = LocalPrefill(self._local_prefill_max_tokens, n - cached if decision.local else 0)
        return Placing(d, p, decision, n, local,
                       _Claim(d, p, decision, n, local.any_tokens, self.clock()))

    def placed(self, placing: Placing, r: Reservation) -> Target:
        """``d`` granted the reservation: where the prompt is computed, counted where
        the next decisions read it (a prefill worker's leg takes its count over)."""
        d, p, decision, n = placing.d, placing.p, placing.decision, placing.n
        uncached = n - r.reused * self._block_size
        log.debug("placement on %s of %d prompt tokens (%d cached): %s, %s; predicted TTFT "
                  "local %.3f s, remote %.3f s; decoding requests stalled %.3f / %.3f s",
                  d.worker_id, n, n - uncached, "local" if r.local else "remote",
                  decision.reason, decision.ttft_local_s, decision.ttft_remote_s,
                  decision.stall_local_s, decision.stall_remote_s)
        now = self.clock()
        if r.local:
            _Claim(d, None, decision, n, uncached, now, local=True)
            reason = decision.reason if decision.local else "cached_suffix"
            return Target(d, r, None, "local", reason, decision, uncached, self.clock)
        _Claim(d, p, decision, n, 0, now, local=False)
        return Target(d, r, p, "remote", decision.reason, decision, uncached, self.clock)

    def _decide(self, d: WorkerState, p: WorkerState | None, route: RouteInput,
                params: SamplingParams, counted: bool = True) -> tuple[Decision, int]:
        """Where the prompt would be computed if ``d`` takes it, and the prompt tokens
        ``d``'s prefix cache is believed to hold."""
        cached_d = self._cached(d, route)
        cached_p = 0 if p is None else self._block_size * _held(
            self._prefix.view(), route.block_hashes, p.worker_id)
        other = None if p is None else PrefillSide(p.outstanding_tokens,
                                                   p.load.compute if p.load else None,
                                                   p.ttft_bias_s)
        return decide(route.num_prompt_tokens, cached_d, cached_p, self._side(d, counted), other,
                      self.slo, self.mode, params.prompt_logprobs is not None), cached_d

    def _cached(self, w: WorkerState, route: RouteInput) -> int:
        return self._block_size * _held(self._token_prefix.view(), route.block_hashes,
                                        w.worker_id)

    def _side(self, w: WorkerState, counted: bool = False) -> DecodeSide:
        """A token worker as the rule reads it (``counted``: this request is in its
        outstanding count already)."""
        return DecodeSide(w.outstanding_requests - counted, w.local_tokens,
                          w.prompt_time.value(self.clock()) / SHARE_WINDOW_S,
                          w.load.compute if w.load else None, w.ttft_bias_s)


def _held(owners: dict[int, str], hashes: Sequence[int], worker_id: str) -> int:
    """Leading blocks of a prompt the index says ``worker_id`` holds."""
    n = 0
    for h in hashes:
        if owners.get(h) != worker_id:
            break
        n += 1
    return n


class _Claim:
    """What one placement adds to the counts the next decisions read: the prefill
    worker's queued prompt tokens (remote), or the decode worker's own and its recent
    prompt time (local); ``undo`` takes it back."""

    def __init__(self, d: WorkerState, p: WorkerState | None, decision: Decision, n: int,
                 local_tokens: int, now: float, local: bool | None = None) -> None:
        self.d, self.now = d, now
        self.local = decision.local if local is None else local
        self.p = None if self.local else p
        self.n = n
        self.local_tokens = local_tokens if self.local else 0
        # the decode worker's own prompt time (a prefill worker's slows it too, on a
        # shared node, but computing there is no choice of this rule's then)
        stall = decision.stall_local_s if self.local else 0.0
        self.stall = 0.0 if math.isnan(stall) else stall
        self._apply(1)

    def _apply(self, sign: int) -> None:
        self.d.local_tokens += sign * self.local_tokens
        self.d.prompt_time.add(sign * self.stall, self.now)
        if self.p is not None:
            self.p.outstanding_tokens += sign * self.n
            self.p.outstanding_requests += sign

    def undo(self) -> None:
        self._apply(-1)
