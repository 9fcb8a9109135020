"""`pdserve plan` and the autoscale decision: the analytic step times against the
reference arithmetic, pool sizing, the CLI, a measured profile on a tiny model, and
the Autoscaler on synthetic snapshot sequences (no clock, no Ray)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.planner.autoscaler import Autoscaler, LoadSnapshot, PoolLoad
from pdserve.planner.profile import fit_nonnegative, measure_profile
from pdserve.planner.sizing import SLO, Bounds, Planner, ttft_mdl
from pdserve.planner.step_times import (
    AnalyticModel,
    Profile,
    resolve_hardware,
    resolve_model_config,
)

PLAN = ["plan", "--model", "llama-3-70b", "--hardware", "h100", "--tp", "4",
        "--prompt-len", "1024", "--output-len", "256", "--ttft-slo", "500",
        "--tpot-slo", "50"]


def llama70b_4xh100(**kw: float) -> AnalyticModel:
    return AnalyticModel(resolve_model_config("llama-3-70b"), resolve_hardware("h100"), tp=4,
                         **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------- analytic model
def test_reference_arithmetic_llama3_70b_on_4xh100() -> None:
    m = llama70b_4xh100(mfu=0.5)
    # 2·70e9·1024 / (4·989e12·0.5) ≈ 72 ms; the cost model adds attention and the head.
    assert 70 <= m.prefill_ms(1024) <= 80
    back_of_envelope = 2 * 70e9 * 1024 / (4 * 989e12 * 0.5) * 1e3
    assert m.prefill_ms(1024) == pytest.approx(back_of_envelope, rel=0.05)
    # Decode is bandwidth bound: ~140 GB of weights / (4 x 3.35 TB/s) ≈ 10.4 ms/token.
    full = llama70b_4xh100(mbu=1.0)
    assert full.decode_ms(1, 0) == pytest.approx(10.4, abs=0.1)  # 139 GB: no embedding read
    assert full.decode_ms(1, 1024 + 128) >= 10.4  # + the request's KV
    assert m.decode_ms(1, 1024) >= 10.4  # the default MBU (0.8) is slower still
    # A bigger batch reads the same weights once: per-token cost barely moves.
    assert m.decode_ms(32, 1024) < 1.3 * m.decode_ms(1, 1024)
    assert m.decode_ms(8, 1024) > m.decode_ms(4, 1024) > m.decode_ms(1, 1024)


def test_presets_hardware_and_model_dirs(tiny_model: Callable[[str], Path]) -> None:
    cfg = resolve_model_config("Llama-3-8B")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == (32, 4096, 8)
    assert resolve_model_config(str(tiny_model("llama-gqa"))).num_layers == 3
    assert resolve_hardware("h200").bytes_per_s == 4.8e12
    assert resolve_hardware("b200").flops_per_s == 2.25e15
    cpu = resolve_hardware("cpu", peak_flops=1e11, peak_bandwidth=2e10)
    assert (cpu.source, cpu.memory_bytes) == ("given", None)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        resolve_hardware("tpu")
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model_config("gpt-9")
    with pytest.raises(ValueError, match="mfu must be in"):
        llama70b_4xh100(mfu=1.5)


def test_gpu_kv_capacity_is_memory_left_after_the_weights() -> None:
    m = llama70b_4xh100()
    free = 4 * 80e9 * 0.9 - m.weight_memory_bytes
    assert m.default_kv_tokens == int(free // m.kv_bytes_per_token)
    one = AnalyticModel(m.model, m.hardware, tp=1)
    assert one.default_kv_tokens == 0  # 141 GB of weights on one 80 GB GPU
    plan = Planner(one, SLO(1000, 100)).plan(1.0, 1024, 256)
    assert not plan.feasible and "KV cache" in plan.problems[0]


# ------------------------------------------------------------------- sizing
def test_mdl_wait_and_the_capacity_that_just_meets_the_ttft_slo() -> None:
    assert ttft_mdl(100, 0.5) == pytest.approx(150)
    assert ttft_mdl(100, 0.0) == 100
    assert ttft_mdl(100, 1.0) is None
    planner = Planner(llama70b_4xh100(), SLO(300, 50))
    s, cap = planner.prefill_capacity(1024)
    assert ttft_mdl(s, cap * s / 1e3) == pytest.approx(300)


def test_more_rate_never_fewer_workers_and_feasible_plans_meet_the_slos() -> None:
    planner = Planner(llama70b_4xh100(), SLO(500, 30), Bounds(1, 500, 1, 500))
    last = (0, 0)
    for rate in (0.1, 0.5, 1, 2, 5, 10, 13, 20, 40, 80, 160, 320):
        plan = planner.plan(rate, 1024, 256)
        assert plan.feasible, plan.problems
        sizes = (plan.prefill.workers, plan.decode.workers)
        assert sizes[0] >= last[0] and sizes[1] >= last[1]
        last = sizes
        assert plan.prefill.ttft_ms is not None and plan.prefill.ttft_ms <= 500 + 1e-6
        assert plan.decode.tpot_ms is not None and plan.decode.tpot_ms <= 30 + 1e-6
        assert plan.goodput_rps == pytest.approx(rate)
        # smallest: one worker fewer in either pool misses the rate
        if sizes[0] > 1:
            assert (sizes[0] - 1) * plan.prefill.capacity_rps < rate
        if sizes[1] > 1:
            assert (sizes[1] - 1) * plan.decode.capacity_rps < rate
    assert last[0] > 1 and last[1] > 1


def test_min_bounds_and_kv_limit() -> None:
    planner = Planner(llama70b_4xh100(), SLO(500, 50), Bounds(2, 8, 3, 8))
    assert planner.plan(0.1, 1024, 256).sizes == {"prefill": 2, "decode": 3}
    small = Planner(llama70b_4xh100(), SLO(500, 50), kv_tokens=10 * 1280)
    limit, bmax = small.decode_limits(1024, 256)
    assert limit == bmax == 10  # 10 requests of 1280 tokens fit


def test_infeasible_slos_name_the_pool_and_the_slo() -> None:
    m = llama70b_4xh100()
    plan = Planner(m, SLO(50, 5)).plan(1.0, 1024, 256)
    assert not plan.feasible and plan.goodput_rps == 0
    ttft, tpot = plan.problems
    assert ttft.startswith("prefill: the TTFT SLO (50 ms) is below") and "71.6 ms" in ttft
    assert tpot.startswith("decode: the TPOT SLO (5 ms) is below a batch-1 decode step")
    plan = Planner(m, SLO(500, 50), Bounds(1, 2, 1, 64)).plan(100.0, 1024, 256)
    assert plan.sizes["prefill"] == 2 and len(plan.problems) == 1
    assert "--max-prefill is 2" in plan.problems[0]
    assert 0 < plan.goodput_rps < 100
    assert "NOT FEASIBLE" in plan.describe()


# ---------------------------------------------------------------------- CLI
def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--rate", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["source"] == "analytic"
    assert out["ratio"] == f"{out['prefill_workers']}:{out['decode_workers']}"
    assert out["prefill_workers"] == 3 and out["ttft_ms"] <= 500 and out["tpot_ms"] <= 50
    assert out["goodput_rps"] == 30
    assert main([*PLAN, "--rate", "30", "--max-prefill", "2", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["feasible"] and "--max-prefill is 2" in out["problems"][0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "0"], "--rate must be > 0"),
    (["--rate", "1", "--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["--rate", "1", "--model", "/nonexistent/model"], "neither a preset"),
    ([], "needs --rate"),
    (["--rate", "1", "--min-decode", "5", "--max-decode", "2"], "bad decode bounds"),
    (["--rate", "1", "--profile", "/nonexistent.json"], "not found"),
])
def test_cli_bad_input_exits_2(argv: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve: error:") and message in err and "\n" not in err
    assert main(["plan", "--rate", "1", "--prompt-len", "8", "--output-len", "8",
                 "--ttft-slo", "1", "--tpot-slo", "1"]) == 2
    assert "needs --model, --hardware" in capsys.readouterr().err


# ------------------------------------------------------------------ profile
def test_fit_recovers_coefficients_and_keeps_them_nonnegative() -> None:
    rows = [[1.0, n, n * n] for n in (8, 32, 128, 512)]
    y = [2 + 0.5 * r[1] + 0.001 * r[2] for r in rows]
    assert fit_nonnegative(rows, y) == pytest.approx([2, 0.5, 0.001], rel=1e-6)
    y = [5 + 0.1 * r[1] for r in rows]
    y[-1] *= 0.9  # concave: the quadratic term would come out negative
    coef = fit_nonnegative(rows, y)
    assert coef[2] == 0 and min(coef) >= 0


@pytest.fixture(scope="module")
def tiny_profile(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Path:
    prof = measure_profile(tiny_model("llama-gqa"), dtype="float32",
                           prefill_lens=(8, 16, 32, 64), decode_batches=(1, 2, 4),
                           decode_contexts=(16, 48), decode_steps=3, repeats=1)
    return prof.save(tmp_path_factory.mktemp("profile") / "tiny.json")


def test_profile_fit_on_a_tiny_model(tiny_profile: Path) -> None:
    prof = Profile.load(tiny_profile)
    assert prof.threads == 1 and prof.dtype == "float32" and prof.device == "cpu"
    assert prof.clock == "cpu"
    assert min(prof.prefill_coef) >= 0 and min(prof.decode_coef) >= 0
    assert len(prof.samples["prefill"]) == 4 and len(prof.samples["decode"]) == 6
    assert prof.prefill_ms(64) > 0 and prof.decode_ms(4, 48) > 0
    assert prof.prefill_ms(64) >= prof.prefill_ms(8)
    assert prof.kv_tokens > 0 and prof.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4
    assert Profile.load(prof.save(tiny_profile.with_name("again.json"))) == prof


def test_a_profile_of_several_threads_is_timed_on_the_wall_clock(
        tiny_model: Callable[[str], Path]) -> None:
    """A process's CPU time adds its threads' up: two threads computing for 10 ms read
    20 ms on the CPU clock, so a profile of several threads is timed on the wall."""
    prof = measure_profile(tiny_model("llama-gqa"), dtype="float32", threads=2,
                           prefill_lens=(8, 16, 32), decode_batches=(1, 2),
                           decode_contexts=(16,), decode_steps=2, repeats=1)
    assert prof.threads == 2 and prof.clock == "wall"


def test_cli_plans_on_a_profile(tiny_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile.load(tiny_profile)
    ttft = 10 * prof.prefill_ms(32)
    tpot = 3 * prof.decode_ms(1, 48)
    assert main(["plan", "--profile", str(tiny_profile), "--rate", "5", "--prompt-len", "32",
                 "--output-len", "32", "--ttft-slo", str(ttft), "--tpot-slo", str(tpot),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "profile" and out["feasible"]
    assert out["prefill"]["prefill_ms"] == pytest.approx(prof.prefill_ms(32), abs=1e-3)
    bad = tiny_profile.with_name("bad.json")
    bad.write_text("{}")
    assert main([*PLAN, "--rate", "1", "--profile", str(bad)]) == 2
    assert "not a pdserve-planner-profile/1 file" in capsys.readouterr().err


def test_cli_measure_profile(tiny_model: Callable[[str], Path], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    import pdserve.planner.profile as planner

    fast = dict(prefill_lens=(8, 16, 32), decode_batches=(1, 2), decode_contexts=(16,),
                decode_steps=2, repeats=1)
    real = planner.measure_profile
    monkeypatch.setattr(planner, "measure_profile", lambda d, **kw: real(d, **{**kw, **fast}))
    out = tmp_path / "p.json"
    assert main(["plan", "--measure-profile", str(out), "--model",
                 str(tiny_model("llama-gqa")), "--dtype", "float32"]) == 0
    assert "prefill_ms(N) =" in capsys.readouterr().out
    assert Profile.load(out).samples["decode"][0][0] == 1
    assert main(["plan", "--measure-profile", str(out)]) == 2


# --------------------------------------------------------------- autoscaler
@dataclass(frozen=True)
class Linear:
    """Synthetic step times: prefill 100 ms, decode 10 + 1·B ms."""

    source: str = "synthetic"
    kv_bytes_per_token: int = 1
    default_kv_tokens: int | None = None

    def prefill_ms(self, prompt_len: float) -> float:
        return 100.0

    def decode_ms(self, batch: float, context: float) -> float:
        return 10.0 + batch

    def describe(self) -> str:
        return "synthetic"


# Prefill: 100 ms, SLO 200 ms -> x = 1, rho_max = 2/3: 6.67 req/s per worker.
# Decode: TPOT <= 30 ms -> batch 20 at 30 ms, output 101 tokens: 20 / (100·0.03) = 6.67.
SLOS = SLO(200, 30)
BOUNDS = Bounds(1, 6, 1, 6)
PER_WORKER = 20 / 3


def scaler(**kw: int | float) -> Autoscaler:
    return Autoscaler(Planner(Linear(), SLOS, BOUNDS, max_batch=64), 100, 101,
                      **kw)  # type: ignore[arg-type]


def snap(rate: float, p: int, d: int, **kw: float | None) -> LoadSnapshot:
    return LoadSnapshot(PoolLoad(p), PoolLoad(d), arrival_rate=rate, **kw)  # type: ignore[arg-type]


def run(a: Autoscaler, rates: list[float], p: int = 1, d: int = 1,
        **kw: float | None) -> list[tuple[int, int]]:
    """Feed snapshots, applying each decision at once (as the cluster would)."""
    sizes = []
    for r in rates:
        t = a.decide(snap(r, p, d, **kw))
        assert abs(t["prefill"] - p) <= 1 and abs(t["decode"] - d) <= 1
        p, d = t["prefill"], t["decode"]
        sizes.append((p, d))
    return sizes


def test_planner_capacities_of_the_synthetic_worker() -> None:
    plan = Planner(Linear(), SLOS, BOUNDS).plan(PER_WORKER * 2.5, 100, 101)
    assert plan.prefill.capacity_rps == pytest.approx(PER_WORKER)
    assert plan.decode.capacity_rps == pytest.approx(PER_WORKER)
    assert plan.sizes == {"prefill": 3, "decode": 3}


def test_scales_up_one_worker_per_decision_to_the_rate_requirement() -> None:
    a = scaler()
    assert run(a, [PER_WORKER * 3.5] * 5) == [(2, 2), (3, 3), (4, 4), (4, 4), (4, 4)]
    assert a.reasons["prefill"].startswith("hold at 4")


def test_no_flapping_around_a_threshold() -> None:
    a = scaler()
    rates = [PER_WORKER * f for f in (1.9, 2.1) * 10]  # required alternates 2 / 3
    sizes = run(a, rates, p=2, d=2)
    assert sizes[0] == (2, 2) and set(sizes[1:]) == {(3, 3)}


def test_cool_down_before_each_step_down_and_never_below_the_requirement() -> None:
    a = scaler(cooldown=3)
    sizes = run(a, [PER_WORKER * 1.5] * 10, p=5, d=5)  # required 2
    assert sizes == [(5, 5), (5, 5), (4, 4), (4, 4), (4, 4), (3, 3), (3, 3), (3, 3),
                     (2, 2), (2, 2)]
    assert run(a, [PER_WORKER * 1.5] * 6, p=2, d=2) == [(2, 2)] * 6
    assert run(scaler(), [0.0] * 12, p=2, d=2)[-1] == (1, 1)  # idle: down to the minimum


def test_slo_risk_scales_up_and_the_hysteresis_band_blocks_the_way_down() -> None:
    a = scaler(cooldown=2, settle=2)
    rate = PER_WORKER * 0.5  # required 1:1
    # TTFT p90 above 0.9 x 200 ms: prefill grows, then waits `settle` decisions.
    assert run(a, [rate] * 4, p=1, d=1, ttft_p90_ms=190) == [(2, 1), (2, 1), (2, 1), (3, 1)]
    assert a.reasons["prefill"].startswith("at risk: TTFT p90 190.0 ms")
    # p90 in the band (0.7..0.9 x SLO): no risk, but no scaling down either.
    assert run(a, [rate] * 6, p=3, d=1, ttft_p90_ms=150, tpot_p90_ms=25) == [(3, 1)] * 6
    assert run(a, [rate] * 2, p=3, d=1, ttft_p90_ms=100)[-1] == (2, 1)
    # TPOT at risk grows the decode pool only.
    assert run(scaler(), [rate], p=1, d=1, tpot_p90_ms=29) == [(1, 2)]


def test_queue_growth_and_kv_pressure_are_risks() -> None:
    a = scaler(queue_growth=3)
    rate = PER_WORKER * 0.5
    sizes = []
    for waiting in (1, 2, 3, 4):
        t = a.decide(LoadSnapshot(PoolLoad(1, waiting=waiting), PoolLoad(1), arrival_rate=rate))
        sizes.append(t["prefill"])
    assert sizes == [1, 1, 1, 2]  # grew three times running
    a = scaler()
    t = a.decide(LoadSnapshot(PoolLoad(1), PoolLoad(1, kv_usage=0.95), arrival_rate=rate))
    assert t == {"prefill": 1, "decode": 2}
    # a batch near the TPOT limit (20 here) on every decode worker
    t = scaler().decide(LoadSnapshot(PoolLoad(1), PoolLoad(2, running=38), arrival_rate=rate))
    assert t["decode"] == 3


def test_bounds() -> None:
    assert run(scaler(), [PER_WORKER * 50] * 8)[-1] == (6, 6)  # capped at the maximum
    assert run(scaler(), [PER_WORKER * 50] * 3, p=6, d=6, ttft_p90_ms=500) == [(6, 6)] * 3
    a = Autoscaler(Planner(Linear(), SLOS, Bounds(2, 4, 2, 4)), 100, 101)
    assert run(a, [0.0], p=0, d=0) == [(1, 1)]  # below the minimum: one step up
    assert run(a, [0.0], p=7, d=7) == [(6, 6)]  # above the maximum: one step down
    # no arrival rate: estimated from the prefill pool's tokens/s (100-token prompts)
    t = a.decide(LoadSnapshot(PoolLoad(2, prefill_tokens_per_s=100 * PER_WORKER * 3.5),
                              PoolLoad(2)))
    assert t == {"prefill": 3, "decode": 3}
    assert a.last_plan is not None and a.last_plan.sizes == {"prefill": 4, "decode": 4}


def test_observed_lengths_replace_the_configured_ones() -> None:
    a = scaler()
    base = snap(PER_WORKER * 0.9, 1, 1)
    assert a.decide(base) == {"prefill": 1, "decode": 1}
    # outputs twice as long: twice the decode work per request
    assert a.decide(replace(base, output_len=201)) == {"prefill": 1, "decode": 2}


def test_a_profiles_later_chunk_attends_the_earlier_ones() -> None:
    """A prompt prefilled in two chunks costs what it costs whole, plus one step's
    fixed part: the second chunk's tokens attend the first's too."""
    from pdserve.engine.results import StepInfo

    prof = Profile("m", "cpu", "bfloat16", "none", 1, (25.0, 0.3, 4e-4), (25.0, 0.45, 4.5e-3),
                   1024, 65536)
    first = prof.step_ms(StepInfo(1, 512, 0, 512, 0.0))
    second = prof.step_ms(StepInfo(1, 512, 0, 1024, 0.0))
    assert first == pytest.approx(prof.prefill_ms(512), rel=0.01)
    assert first + second == pytest.approx(prof.prefill_ms(1024) + 25.0, rel=0.01)
    assert prof.step_ms(StepInfo(4, 4, 4, 800, 0.0)) == pytest.approx(prof.decode_ms(4, 200))
