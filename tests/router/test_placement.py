"""The disaggregation decision (pdserve/router/placement.py): a pure function of the
request, the two workers' queues and measured step times, and the SLOs."""

from __future__ import annotations

import pytest

from pdserve.messages import Compute, StepCost
from pdserve.router.placement import (
    REASONS,
    DecayedSum,
    DecodeSide,
    PrefillSide,
    Slo,
    colocated_first,
    decide,
)

# A CPU node's measured costs: one thread, or both (decode gains 1.4x, prompts 1.9x).
ONE = StepCost(((1, 0.022), (32, 0.040)), 0.012, 0.00036, 1e-7, 50, 50)
TWO = StepCost(((1, 0.016), (32, 0.028)), 0.008, 0.00019, 5e-8, 50, 50)


def compute(group: str | None = "node-a") -> Compute:
    return Compute(1, 2, group, {1: ONE, 2: TWO})


def d(running: int = 0, queued: int = 0, share: float = 0.0,
      c: Compute | None = None) -> DecodeSide:
    return DecodeSide(running, queued, share, c or compute())


def p(queued: int = 0, c: Compute | None = None) -> PrefillSide:
    return PrefillSide(queued, c or compute())


def test_fixed_answers() -> None:
    assert decide(100, 0, 0, d(), None, Slo()).reason == "no_prefill_worker"
    assert decide(100, 0, 0, d(), p(), Slo(), needs_every_position=True).reason == "prompt_logprobs"
    assert decide(100, 0, 0, d(), p(), Slo(), mode="static").reason == "static"
    bare = Compute(1, 2, "node-a", {})
    got = decide(100, 0, 0, d(c=bare), p(c=bare), Slo())
    assert (got.local, got.reason) == (False, "unmeasured")


def test_a_short_prompt_on_an_idle_node_is_computed_where_it_decodes() -> None:
    got = decide(128, 0, 0, d(), p(), Slo())
    assert (got.local, got.reason) == (True, "faster_here")
    assert got.ttft_local_s <= got.ttft_remote_s


def test_a_long_prompt_goes_to_the_prefill_worker_when_requests_decode() -> None:
    got = decide(4000, 0, 0, d(running=8), p(), Slo())
    assert (got.local, got.reason) == (False, "protects_tpot")
    assert got.stall_local_s > got.stall_remote_s
    # with a TPOT target: the stall is spread over the decoding requests' tokens
    # (SHARE_WINDOW_S), local where they keep it, remote where they would not
    assert decide(4000, 0, 0, d(running=8), p(), Slo(tpot_s=0.06)).local
    assert decide(4000, 0, 0, d(running=8), p(), Slo(tpot_s=0.025)).reason == "protects_tpot"


def test_short_prompts_stay_local_behind_a_busy_prefill_worker() -> None:
    got = decide(128, 0, 0, d(running=8), p(queued=4000), Slo())
    assert (got.local, got.reason) == (True, "faster_here")


def test_the_decode_workers_recent_prompt_time_counts() -> None:
    fresh = decide(256, 0, 0, d(running=8), p(queued=600), Slo())
    busy = decide(256, 0, 0, d(running=8, share=0.3), p(queued=600), Slo())
    assert fresh.local and not busy.local and busy.reason == "protects_tpot"


def test_within_the_ttft_slo_a_shared_node_computes_locally() -> None:
    # the prefill worker would answer sooner, but both are in time: no transfer
    slo = Slo(ttft_s=1.0)
    got = decide(512, 0, 0, d(running=1, queued=1024), p(), slo)
    assert got.ttft_remote_s < got.ttft_local_s <= 1.0
    assert (got.local, got.reason) == (True, "within_ttft_slo")
    # on separate nodes the prefill worker's own cores cost the decoding nothing
    apart = decide(512, 0, 0, d(running=1, queued=1024, c=compute("node-a")),
                   p(c=compute("node-b")), slo)
    assert (apart.local, apart.reason) == (False, "faster_remote")
    assert apart.stall_remote_s == 0


def test_cached_prefixes_make_their_side_cheaper() -> None:
    cold = decide(3000, 0, 0, d(running=4), p(), Slo())
    warm = decide(3000, 2944, 0, d(running=4), p(), Slo())  # all but 56 tokens held here
    assert not cold.local and warm.local


def test_remote_prompts_on_a_shared_node_stall_decoding() -> None:
    got = decide(1024, 0, 0, d(running=16), p(), Slo())
    assert 0 < got.stall_remote_s < got.stall_local_s
    apart = decide(1024, 0, 0, d(running=16, c=compute(None)), p(c=compute(None)), Slo())
    assert apart.stall_remote_s == 0


@pytest.mark.parametrize("n", [1, 64, 500, 2000, 8000])
def test_every_reason_is_a_known_label(n: int) -> None:
    for running in (0, 4, 32):
        for queued in (0, 5000):
            got = decide(n, 0, 0, d(running=running), p(queued=queued), Slo(0.5, 0.05))
            assert got.reason in REASONS["local" if got.local else "remote"]


def test_decayed_sum() -> None:
    s = DecayedSum(2.0)
    s.add(1.0, 10.0)
    assert s.value(10.0) == 1.0
    assert s.value(12.0) == pytest.approx(0.3679, rel=1e-3)
    s.add(1.0, 12.0)
    assert s.value(12.0) == pytest.approx(1.3679, rel=1e-3)


def test_a_colocated_worker_goes_first_when_it_answers_sooner_within_tpot() -> None:
    pair = decide(300, 0, 0, d(running=8), p(queued=6000), Slo())  # a busy pair: local
    assert pair.local
    idle = DecodeSide(0, 0, 0.0, compute(None))
    assert colocated_first(300, 0, idle, pair, Slo())
    busy = DecodeSide(12, 2000, 0.0, compute(None))  # its own queue ahead of the prompt
    assert not colocated_first(300, 0, busy, pair, Slo())
    # a long prompt would stall the colocated worker's decoding past its TPOT target
    long_pair = decide(4000, 0, 0, d(running=2), p(queued=20000), Slo())
    decoding = DecodeSide(8, 0, 0.0, compute(None))
    assert not colocated_first(4000, 0, decoding, long_pair, Slo())
    # nothing measured there, or nothing predicted for the pair: the policy's order
    assert not colocated_first(300, 0, DecodeSide(0, 0, 0.0, Compute(1, 2, None, {})), pair,
                               Slo())
    assert not colocated_first(300, 0, idle, decide(300, 0, 0, d(), p(), Slo(), "static"),
                               Slo())
