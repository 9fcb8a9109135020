"""Whole simulated runs: the fast path changes nothing, runs repeat exactly, the
router's rules show in where prompts go, and overload ends in 429s, never a hang."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.sim.run import Simulation, simulate
from pdserve.sim.workload import plan
from tests.sim.helpers import deployment, workload

PAIRS = {"prefill": {"workers": 2}, "decode": {"workers": 2}}
COLOCATED = {"prefill": {"workers": 0}, "decode": {"workers": 0}, "colocated": {"workers": 2}}
BOTH = {**PAIRS, "colocated": {"workers": 1}}


def _run(config: dict[str, Any], rate: float, fast: bool, **kw: Any) -> dict[str, Any]:
    cfg = workload(**kw)
    return simulate(deployment(config), plan(cfg, rate, 8192), cfg, rate, {}, fast=fast)


@pytest.mark.parametrize("config", [PAIRS, COLOCATED, BOTH], ids=["pairs", "colocated", "both"])
def test_steady_runs_change_nothing(config: dict[str, Any]) -> None:
    """Decode steps taken together give every token the time single steps give it."""
    fast, exact = (_run(config, 12.0, f) for f in (True, False))
    for key in ("ttfts", "latencies", "output_lens"):
        assert fast[key] == pytest.approx(exact[key], rel=1e-9, abs=1e-9), key
    assert [len(i) for i in fast["itls"]] == [len(i) for i in exact["itls"]]
    assert fast["simulation"]["placement"] == exact["simulation"]["placement"]
    assert fast["simulation"]["events"] < exact["simulation"]["events"]


def test_engines_drop_a_prefix_cache_that_could_never_hit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a block two prompts share, the engines run without a prefix cache
    (nothing hashed or registered), and every latency is what it is with one."""
    import pdserve.sim.run as run

    cfg = workload()
    planned = plan(cfg, 12.0, 8192)
    without = Simulation(deployment(PAIRS), planned)
    assert not any(w.engine.pool.enable_prefix_caching for w in without.workers)
    monkeypatch.setattr(run, "shares_blocks", lambda planned, bs: True)
    kept = Simulation(deployment(PAIRS), planned)
    assert all(w.engine.pool.enable_prefix_caching for w in kept.workers)
    a, b = without.run(), kept.run()
    assert [(o.ttft, o.latency, o.itl) for o in a[0]] == [(o.ttft, o.latency, o.itl)
                                                           for o in b[0]]
    shared = plan(workload(random_prefix_len=64), 12.0, 8192)
    assert all(w.engine.pool.enable_prefix_caching
               for w in Simulation(deployment(PAIRS), shared).workers)


def test_peak_output_throughput_without_every_tokens_time() -> None:
    """The client's peak counts each token's time; a run that keeps none (no ITL
    asked for) counts the same tokens per second itself."""
    kept = _run(PAIRS, 12.0, True)
    counted = _run(PAIRS, 12.0, True, percentile_metrics=("ttft", "tpot"))
    assert counted["itls"] == [[]] * 120
    assert counted["max_output_tokens_per_s"] == kept["max_output_tokens_per_s"] > 64


def test_a_run_repeats_exactly() -> None:
    a, b = (_run(PAIRS, 20.0, True) for _ in range(2))
    assert a["ttfts"] == b["ttfts"] and a["latencies"] == b["latencies"]


def test_every_request_served_with_its_lengths() -> None:
    r = _run(PAIRS, 8.0, True, num_prompts=60)
    assert r["completed"] == 60 and r["failed"] == 0
    cfg = workload(num_prompts=60)
    assert r["output_lens"] == [p.output_len for p in plan(cfg, 8.0, 8192)]
    assert all(len(itl) == n - 1 for itl, n in zip(r["itls"], r["output_lens"], strict=True))
    sim = r["simulation"]
    assert sum(sim["placement"].values()) == 60
    assert sim["kv_bytes_sent"] > 0


def test_static_placement_sends_every_prompt_to_a_prefill_worker() -> None:
    r = _run({**PAIRS, "router": {"placement": "static", "local_prefill_max_tokens": 0}},
             8.0, True, num_prompts=40)
    assert r["simulation"]["placement"] == {"remote": 40}
    # the same counts where a served run's --scrape-metrics puts the router's counter
    assert r["server_placements"] == {"remote": 40}


def test_the_decision_computes_short_prompts_locally_when_that_is_faster() -> None:
    """Measured placement: a 16-token prompt on an idle pair costs less on the decode
    worker (no hop, no transfer) -- the rule says so, as it does served."""
    r = _run(PAIRS, 2.0, True, num_prompts=20, random_input_len=16, random_range_ratio=0.0)
    assert r["simulation"]["placement"].get("local", 0) > 0


def test_overload_ends_in_429s_not_a_hang() -> None:
    """A decode pool too small for the burst: the waiting queue holds what it may, the
    rest is refused at once or after its queue timeout, and every request ends."""
    tight = {"prefill": {"workers": 1}, "decode": {"workers": 1, "engine": {"num_blocks": 200}},
             "router": {"max_waiting": 4, "queue_timeout_s": 0.5}}
    cfg = workload(num_prompts=40, random_input_len=1024, random_range_ratio=0.0,
                   random_output_len=400)
    sim = Simulation(deployment(tight), plan(cfg, float("inf"), 8192))
    outputs, _ = sim.run()
    failed = [o for o in outputs if not o.success]
    assert failed and all(o.error.startswith("HTTP 429") for o in failed)
    assert any(o.success for o in outputs)
    for w in sim.workers:
        w.engine.pool.check_integrity()
        assert w.engine.pool.num_free == w.engine.shape.num_blocks  # everything released


def test_max_concurrency_caps_requests_in_flight() -> None:
    r = _run(PAIRS, float("inf"), True, num_prompts=30, max_concurrency=3)
    assert r["max_concurrent_requests"] <= 3
    assert max(r["queue_times"]) > 0


def test_a_request_admitted_as_another_ends_waits_for_the_next_step() -> None:
    """A decode worker too small for the load: each request that ends admits a queued
    one onto the same worker while its step is being reported; that one joins the
    worker's next step -- not a second step started beside it."""
    tight = {"prefill": {"workers": 1}, "decode": {"workers": 1, "engine": {"num_blocks": 300}},
             "colocated": {"workers": 1, "engine": {"num_blocks": 300}},
             "router": {"queue_timeout_s": 600}}
    cfg = workload(num_prompts=40, random_input_len=1024, random_output_len=200)
    fast, exact = (simulate(deployment(tight), plan(cfg, 50.0, 8192), cfg, 50.0, {}, fast=f)
                   for f in (True, False))
    assert fast["completed"] == exact["completed"] == 40
    assert fast["ttfts"] == pytest.approx(exact["ttfts"], rel=1e-9)
    assert fast["latencies"] == pytest.approx(exact["latencies"], rel=1e-9)


def test_a_reservation_during_a_run_finds_the_step_in_flights_blocks_taken() -> None:
    """8k-token prompts fill the decode workers' KV: a reservation that takes the last
    free blocks while a steady run is in flight must leave that step the blocks it took
    when it started (the run applied its steps later, and ran out)."""
    from pdserve.planner.sizing import SLO
    from pdserve.planner.step_times import AnalyticModel
    from pdserve.sim.link import get_link
    from pdserve.sim.plan import Candidate, evaluate
    from pdserve.sim.plan import workload as plan_workload
    from tests.sim.helpers import H100, MODEL

    model = AnalyticModel(MODEL, H100)
    slo = SLO(5 * model.prefill_ms(8192), 3 * model.decode_ms(1, 8192))
    out = evaluate(Candidate(1, 3, 0, 1), lambda tp: model, get_link("infiniband"),
                   plan_workload(4e3 / model.prefill_ms(8192), 8192, 256, 20, slo), 8448)
    assert out.attainment > 0
