"""``pdserve plan --simulate``: sizes chosen by simulated attainment."""

from __future__ import annotations

import json

import pytest

from pdserve.cli.main import build_parser, main
from pdserve.planner.sizing import SLO
from pdserve.sim.plan import Candidate, Outcome, choose

PLAN = ["plan", "--simulate", "--model", "llama-3-8b", "--hardware", "h100",
        "--prompt-len", "1024", "--output-len", "64", "--duration", "20"]


def test_the_fewest_gpus_that_meet_the_slos(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--rate", "6", "--ttft-slo", "300", "--tpot-slo", "40",
                 "--tp-options", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    choice, cands = out["choice"], out["candidates"]
    assert choice["slo_attainment"] >= 0.9
    assert not [c for c in cands if c["slo_attainment"] >= 0.9 and c["gpus"] < choice["gpus"]]
    assert {c["tp"] for c in cands} == {1, 2}
    assert any(c["colocated_workers"] for c in cands) and any(c["prefill_workers"] for c in cands)
    # the command that serves the choice as it was simulated, its router told the SLO
    serve = out["serve"].split()
    assert serve[:2] == ["pdserve", "serve"] and serve[-4:] == [
        "--ttft-slo-ms", "300", "--tpot-slo-ms", "40"]
    assert build_parser().parse_args(serve[1:]).command == "serve"  # flags serve takes
    flags = dict(zip(serve[2::2], serve[3::2], strict=True))
    assert [int(flags[f"--{p}-workers"]) for p in ("prefill", "decode", "colocated")] == [
        choice["prefill_workers"], choice["decode_workers"], choice["colocated_workers"]]


def test_no_size_meets_an_impossible_slo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--rate", "2", "--ttft-slo", "1", "--tpot-slo", "1"]) == 1
    assert "no candidate reaches 90%" in capsys.readouterr().out


def test_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--rate", "0", "--ttft-slo", "300", "--tpot-slo", "40"]) == 2
    assert "--rate must be > 0" in capsys.readouterr().err
    assert main([*PLAN, "--rate", "1", "--ttft-slo", "300", "--tpot-slo", "40",
                 "--tp-options", "0"]) == 2
    assert "--tp-options" in capsys.readouterr().err


def test_ties_go_to_the_most_headroom() -> None:
    slo = SLO(100.0, 10.0)
    a = Outcome(Candidate(1, 1, 0, 1), 1.0, 5.0, 90.0, 9.0, {})
    b = Outcome(Candidate(0, 0, 2, 1), 1.0, 5.0, 50.0, 5.0, {})
    c = Outcome(Candidate(0, 0, 1, 1), 0.5, 2.0, 500.0, 50.0, {})
    assert choose([a, b, c], slo) is b
    assert choose([c], slo) is None


def test_each_candidates_router_is_told_the_slo(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a deployment serving the workload would be (``--ttft-slo-ms``,
    ``--tpot-slo-ms``): the placement rule keeps decodes within the TPOT target."""
    import pdserve.sim.plan as plan
    from pdserve.planner.step_times import AnalyticModel
    from pdserve.sim.link import get_link
    from tests.sim.helpers import H100, MODEL

    told = []
    build = plan.build
    monkeypatch.setattr(plan, "build", lambda cluster, *a: told.append(cluster) or build(
        cluster, *a))
    model = AnalyticModel(MODEL, H100)
    plan.evaluate(Candidate(1, 1, 0, 1), lambda tp: model, get_link("infiniband"),
                  plan.workload(2.0, 512, 16, 10, SLO(300, 40)), 1024)
    (cluster,) = told
    assert (cluster.ttft_slo_ms, cluster.tpot_slo_ms) == (300, 40)
    assert plan.build(cluster, lambda pool: model, "gpu", get_link("infiniband"),
                      1024).slo.tpot_s == pytest.approx(0.04)
