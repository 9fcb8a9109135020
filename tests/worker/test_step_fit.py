"""A worker's measured step times (pdserve/worker/step_fit.py): decode steps by batch size,
prompt tokens by the context they attend; the calibration's varied steps keep a
prefill worker's alike live steps from blurring how time depends on size."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.messages import StepCost
from pdserve.worker.step_fit import StepFit, calibrate


def step_s(rows: int, tokens: int, pairs: float) -> float:
    """The machine of these tests: 20 ms a step, 0.5 ms a decode row, 0.3 ms a prompt
    token, 2 ns an attended pair."""
    return 0.020 + 0.0005 * rows + (0.010 + 0.0003 * tokens if tokens else 0) + 2e-9 * pairs


def prompt_pairs(n: int) -> float:
    return n * (n + 1) / 2


def test_the_fit_recovers_the_step_times() -> None:
    fit = StepFit()
    for rows in (1, 4, 16, 32):
        fit.observe(1, rows, 0, rows * 100, step_s(rows, 0, 0), calibration=True)
    for n in (16, 128, 512, 2048):
        fit.observe(1, 0, n, prompt_pairs(n), step_s(0, n, prompt_pairs(n)), calibration=True)
    cost = fit.costs()[1]
    assert cost.decode_s(8) == pytest.approx(step_s(8, 0, 0), rel=0.02)
    assert cost.decode_s(64) == pytest.approx(step_s(64, 0, 0), rel=0.02)  # extrapolated
    for n in (100, 1000, 4000):
        assert cost.prompt_base_s + cost.prefill_s(n, 0) == pytest.approx(
            step_s(0, n, prompt_pairs(n)), rel=0.05)


def test_alike_live_steps_do_not_blur_the_calibration() -> None:
    fit = StepFit()
    for n in (16, 128, 512):
        fit.observe(2, 0, n, prompt_pairs(n), step_s(0, n, prompt_pairs(n)), calibration=True)
    # under load: only full 512-token chunks, 10% slower than calibrated
    for _ in range(300):
        fit.observe(2, 0, 512, prompt_pairs(512), 1.1 * step_s(0, 512, prompt_pairs(512)))
    cost = fit.costs()[2]
    full = cost.prompt_base_s + cost.prefill_s(512, 0)
    assert full == pytest.approx(1.1 * step_s(0, 512, prompt_pairs(512)), rel=0.05)
    small = cost.prompt_base_s + cost.prefill_s(128, 0)  # still much cheaper than a full one
    assert small < 0.5 * full


def test_mixed_steps_charge_prompt_tokens_beyond_the_decode_rows() -> None:
    fit = StepFit()
    for rows in (1, 16):
        fit.observe(1, rows, 0, 0, step_s(rows, 0, 0), calibration=True)
    for n in (64, 256, 512):  # a decode worker's local prompt beside 8 decoding rows
        fit.observe(1, 8, n, prompt_pairs(n), step_s(8, n, prompt_pairs(n)), calibration=True)
    cost = fit.costs()[1]
    assert cost.prefill_s(300, 0) + cost.prompt_base_s == pytest.approx(
        step_s(8, 300, prompt_pairs(300)) - 8 * 0.0005, rel=0.1)


def test_a_decode_table_interpolates_and_extrapolates() -> None:
    c = StepCost(((1, 0.010), (8, 0.017), (32, 0.041)), 0, 0, 0)
    assert c.decode_s(1) == 0.010 and c.decode_s(0) == 0.010
    assert c.decode_s(20) == pytest.approx(0.029)
    assert c.decode_s(64) == pytest.approx(0.073)
    assert StepCost((), 0, 0, 0).decode_s(4) == 0.0


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_calibration_steps_varied_shapes_and_leaves_nothing(tiny_model, role: str) -> None:  # type: ignore[no-untyped-def]
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(role=role, num_blocks=128))  # type: ignore[arg-type]
    infos = []
    calibrate(eng, lambda: eng.step().info, infos.append, role)
    shapes = {(i.num_decode, i.num_tokens - i.num_decode) for i in infos}
    assert {(1, 0), (4, 0), (16, 0)} <= shapes  # decode-sized
    assert len({t for d, t in shapes if t}) == 3  # three prompt sizes
    assert not eng.has_unfinished() and not eng.requests
    eng.check_integrity()
    assert eng.pool.num_used == 0


def test_calibration_stops_where_it_cannot_step(tiny_model) -> None:  # type: ignore[no-untyped-def]
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(role="decode", num_blocks=128))
    infos = []
    calibrate(eng, lambda: None, infos.append, "decode")  # e.g. the node's cores taken
    assert infos == [] and not eng.requests and eng.pool.num_used == 0
