"""The DistServe goodput of a sweep: interpolation, bounds, noisy curves."""

from __future__ import annotations

import pytest

from pdserve.client.sweep import describe_goodput, distserve_goodput


def _rows(*points: tuple[float | str, float | None]) -> list[dict[str, object]]:
    return [{"request_rate": rate, "slo_attainment": att} for rate, att in points]


def test_interpolated_between_the_rates_around_the_crossing() -> None:
    g = distserve_goodput(_rows((1.0, 1.0), (2.0, 1.0), (4.0, 0.5)))
    assert g is not None and g["bound"] == "interpolated" and g["between"] == [2.0, 4.0]
    # 1.0 at 2 req/s to 0.5 at 4 req/s: 0.9 is reached a fifth of the way.
    assert g["rate"] == pytest.approx(2.4)
    assert "2.4 req/s (interpolated between 2 and 4 req/s)" in describe_goodput(g)


def test_rows_in_any_order_and_exactly_on_target() -> None:
    g = distserve_goodput(_rows((4.0, 0.5), (1.0, 0.95), (2.0, 0.9)))
    assert g is not None and g["rate"] == pytest.approx(2.0)


def test_a_noisy_curve_takes_the_highest_rate_meeting_the_target() -> None:
    g = distserve_goodput(_rows((1.0, 0.85), (2.0, 0.95), (3.0, 0.45)))
    assert g is not None and g["between"] == [2.0, 3.0]
    assert g["rate"] == pytest.approx(2.1)


def test_bounds_when_the_sweep_does_not_cross() -> None:
    high = distserve_goodput(_rows((1.0, 1.0), (2.0, 0.92)))
    assert high == {"target": 0.9, "rate": 2.0, "bound": "at_least", "between": [2.0, None]}
    assert "at least 2 req/s" in describe_goodput(high)
    low = distserve_goodput(_rows((1.0, 0.5), (2.0, 0.1)))
    assert low is not None and low["rate"] is None and low["bound"] == "below"
    assert "below 1 req/s" in describe_goodput(low)


def test_target_infinite_rates_and_no_slos() -> None:
    g = distserve_goodput(_rows((1.0, 0.8), (2.0, 0.6), ("inf", 0.0)), target=0.7)
    assert g is not None and g["rate"] == pytest.approx(1.5) and g["target"] == 0.7
    assert distserve_goodput(_rows((1.0, None), (2.0, None))) is None
    assert distserve_goodput(_rows(("inf", 1.0))) is None
    with pytest.raises(ValueError, match="target"):
        distserve_goodput(_rows((1.0, 1.0)), target=1.5)
