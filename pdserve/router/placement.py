"""Where a request's prompt is computed: the router's disaggregation decision.

A request admitted on a decode worker D has its prompt's uncached part computed

* **remote**: by a prefill worker P, which moves the KV into D's reserved blocks; or
* **local**: by D itself, as a chunk of its own next steps (no KV moves).

``decide`` chooses for one request from a snapshot: the request's size and the
prefix each side already holds, each worker's queue (the router's own fresh counts),
D's running batch, both workers' measured step times (``worker/step_fit.py``, published in
``WorkerLoad.compute``) and the deployment's SLOs. It is a pure function, so the
router, the simulator and the tests run the same rule.

What each choice is predicted to cost, from the measured step times at the threads
each worker would have (on a node whose cores P and D share, ``worker/core_share.py``, a
worker alone computing gets the other's cores too):

* TTFT: the queue ahead of the prompt on that worker, then the prompt itself (local:
  plus one of D's decode steps, which it shares), plus what that path's first tokens
  recently took beyond their predictions (``learn``: the calls, the hops, a worker's
  first step after an idle spell -- what the step times do not show).
* ``stall``: seconds added to every request D is decoding. Local: the prompt's whole
  compute time (it runs inside D's steps). Remote: nothing, unless P takes cores D
  would otherwise have: then D's steps run on its own cores for that long, slower by
  the measured ratio.

The choice: first, the fewer expected SLO misses -- this request's TTFT target, and,
with a TPOT target, D's running requests (counted when D's share of time spent on
prompts, decayed over ``SHARE_WINDOW_S`` and with this prompt added, would stretch
their steps past the target: TPOT ~ decode step / (1 - share)); then the smaller
latency cost, TTFT + running requests x stall (the request-seconds the choice adds).
Reasons name what decided (``REASONS``); every decision is counted by reason and
shown in the request's stage timings.

Until the workers have measured enough steps (a few of each kind), and with
``placement: static``, the rule is the fixed one: D computes the prompt only when its
own prefix cache holds all but ``local_prefill_max_tokens`` of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.messages import Compute, StepCost

MODES = ("measured", "static")
MIN_STEPS = 3.0  # decayed samples of a kind before a fit's coefficient is used
SHARE_WINDOW_S = 2.0  # the decode worker's recent prompt time is decayed over this
# without a TPOT target, prompts computed on a decode worker may stretch its decoding
# requests' time per token by at most this factor
STRETCH = 1.5
# why a prompt was placed where it was (the metrics' ``reason`` label)
REASONS = {
    "local": ("faster_here", "within_ttft_slo", "cached_suffix", "no_prefill_worker"),
    "remote": ("protects_tpot", "faster_remote", "static", "unmeasured", "prompt_logprobs"),
    "colocated": ("colocated", "faster_colocated"),
}


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True)
class DecodeSide:
    """The decode worker, as the router sees it now."""

    running: int  # requests admitted there and not finished (decoding, or soon)
    queued_tokens: int  # prompt tokens it computes itself ahead of this request
    prompt_share: float  # share of its recent time spent on prompts (decayed)
    compute: Compute | None
    ttft_bias_s: float = 0.0  # what its local first tokens took beyond the prediction


@dataclass(frozen=True)
class PrefillSide:
    queued_tokens: int  # prompt tokens dispatched to it, not yet prefilled
    compute: Compute | None
    ttft_bias_s: float = 0.0  # what its first tokens took beyond the prediction


@dataclass(frozen=True)
class Decision:
    local: bool
    reason: str
    ttft_local_s: float = math.nan
    ttft_remote_s: float = math.nan
    stall_local_s: float = math.nan
    stall_remote_s: float = math.nan


def decide(prompt_tokens: int, cached_here: int, cached_remote: int, d: DecodeSide,
           p: PrefillSide | None, slo: Slo, mode: str = "measured",
           needs_every_position: bool = False) -> Decision:
    """Local or remote for one request (the module docstring). ``cached_here`` /
    ``cached_remote``: prompt tokens D's / P's prefix cache is believed to hold."""
    if p is None:
        return Decision(True, "no_prefill_worker")
    if needs_every_position:  # prompt logprobs: only a prefill worker computes them all
        return Decision(False, "prompt_logprobs")
    if mode == "static":
        return Decision(False, "static")
    shared = (d.compute is not None and p.compute is not None
              and d.compute.core_group is not None
              and d.compute.core_group == p.compute.core_group)
    p_busy, d_busy = p.queued_tokens > 0, d.running > 0 or d.queued_tokens > 0
    d_threads = _threads(d.compute, alone=shared and not p_busy)
    p_threads = _threads(p.compute, alone=shared and not d_busy)
    cd = _costs(d.compute, p.compute, d_threads)
    cp = _costs(p.compute, d.compute, p_threads)
    if cd is None or cp is None:
        return Decision(False, "unmeasured")
    (d_decode, d_prompt), (_, p_prompt) = cd, cp
    b = d.running
    ttft_local, t_local, step_now = _local(prompt_tokens, cached_here, d, d_decode, d_prompt)
    t_remote = p_prompt.prefill_s(max(1, prompt_tokens - cached_remote), cached_remote)
    ttft_remote = max(0.0, p_prompt.queue_s(p.queued_tokens) + t_remote
                      + p_prompt.prompt_base_s + p.ttft_bias_s)
    stall_remote = 0.0
    if shared and b and d.compute is not None:
        own = _costs(d.compute, p.compute, d.compute.own_threads)
        most = _costs(d.compute, p.compute, d.compute.most_threads)
        if own is not None and most is not None:
            slow, fast = own[0].decode_s(b), most[0].decode_s(b)
            if slow > fast:
                stall_remote = t_remote * (1 - fast / slow)
    ev = Decision(False, "", ttft_local, ttft_remote, t_local, stall_remote)
    if _stalls_decoding(d, t_local, step_now, slo):
        return _as(ev, False, "protects_tpot")
    if ttft_local <= ttft_remote:
        return _as(ev, True, "faster_here")
    if shared and slo.ttft_s is not None and ttft_local <= slo.ttft_s:
        # both in time: no transfer, and batched with the decode step
        return _as(ev, True, "within_ttft_slo")
    return _as(ev, False, "faster_remote")


def colocated_first(prompt_tokens: int, cached: int, c: DecodeSide, pair: Decision,
                    slo: Slo) -> bool:
    """Where a deployment has both: whether colocated worker ``c`` (the policy's first)
    should be tried before the decode worker whose decision for this request is
    ``pair`` -- its first token predicted sooner, and computing the prompt there keeps
    its decoding requests within their TPOT target."""
    costs = _costs(c.compute, None, c.compute.most_threads) if c.compute else None
    pair_ttft = pair.ttft_local_s if pair.local else pair.ttft_remote_s
    if costs is None or math.isnan(pair_ttft):
        return False
    ttft, stall, step = _local(prompt_tokens, cached, c, *costs)
    return not _stalls_decoding(c, stall, step, slo) and ttft < pair_ttft


def _local(prompt_tokens: int, cached: int, d: DecodeSide, decode: StepCost,
           prompt: StepCost) -> tuple[float, float, float]:
    """A prompt computed on a token worker: (TTFT, what it adds to its decoding
    requests, the step it joins -- the decode step, or one of its own)."""
    step = decode.decode_s(d.running) if d.running else prompt.prompt_base_s
    stall = prompt.prefill_s(max(1, prompt_tokens - cached), cached)
    return max(0.0, prompt.queue_s(d.queued_tokens) + stall + step + d.ttft_bias_s), stall, step


def _stalls_decoding(d: DecodeSide, stall: float, step: float, slo: Slo) -> bool:
    """Would ``stall`` more of prompt compute stretch the worker's decoding requests
    past their TPOT target (``slo.tpot_s``; else ``STRETCH`` x its decode step)?"""
    target = slo.tpot_s if slo.tpot_s is not None else STRETCH * step
    return bool(d.running) and _stretched(d.prompt_share + stall / SHARE_WINDOW_S, step, target)


def _as(ev: Decision, local: bool, reason: str) -> Decision:
    return Decision(local, reason, ev.ttft_local_s, ev.ttft_remote_s, ev.stall_local_s,
                    ev.stall_remote_s)


def _stretched(share: float, step: float, target: float) -> bool:
    """Decoding requests whose worker spends ``share`` of its time on prompts take
    ~step / (1 - share) a token: past ``target``?"""
    return share >= 1 or step / (1 - share) > target


def _threads(c: Compute | None, alone: bool) -> int:
    if c is None:
        return 1
    return c.most_threads if alone else c.own_threads


def _costs(mine: Compute | None, other: Compute | None,
           threads: int) -> tuple[StepCost, StepCost] | None:
    """``mine``'s step costs at ``threads``, (for decode steps, for prompt tokens): its
    own fit where it measured enough of that kind, else the other worker's (the same
    model on the same kind of device), each from the nearest thread count measured
    (scaled by the thread ratio). None: neither measured enough."""
    decode = _measured(mine, threads, "decode_steps") or _measured(other, threads, "decode_steps")
    prompt = (_measured(mine, threads, "prefill_steps")
              or _measured(other, threads, "prefill_steps"))
    if decode is None or prompt is None:
        return None
    return decode, prompt


def _measured(c: Compute | None, threads: int, kind: str) -> StepCost | None:
    if c is None:
        return None
    fits = [(t, f) for t, f in c.costs.items() if getattr(f, kind) >= MIN_STEPS]
    if not fits:
        return None
    t, f = min(fits, key=lambda tf: (abs(tf[0] - threads), -tf[0]))
    k = t / threads
    return StepCost(tuple((r, sec * k) for r, sec in f.decode), f.prompt_base_s * k,
                    f.token_s * k, f.pair_s * k, f.decode_steps, f.prefill_steps)


class DecayedSum:
    """A sum whose terms fade exponentially with time constant ``tau_s``."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._value = 0.0
        self._at = 0.0

    def value(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._at) / self.tau_s)

    def add(self, x: float, now: float) -> None:
        self._value = self.value(now) + x
        self._at = now


BIAS_WEIGHT = 0.25  # a first token's weight in its path's running TTFT correction


def learn(bias_s: float, predicted_s: float, took_s: float) -> float:
    """A path's TTFT correction after one first token that took ``took_s`` from its
    placement where ``predicted_s`` (the correction included) was predicted."""
    return bias_s + BIAS_WEIGHT * (took_s - predicted_s)
