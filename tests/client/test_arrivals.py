"""Arrival process: Poisson / gamma gaps have the asked mean rate and spread."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.client.request_runner import arrival_offsets


def _gaps(rate: float, burstiness: float, n: int = 4001) -> np.ndarray:
    offsets = arrival_offsets(n, rate, burstiness, seed=7)
    assert offsets[0] == 0.0 and len(offsets) == n
    return np.diff(offsets)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_mean_rate_and_spread(burstiness: float) -> None:
    gaps = _gaps(rate=20.0, burstiness=burstiness)
    assert (gaps >= 0).all()
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.1)
    # Gamma(shape k): coefficient of variation 1/sqrt(k) (1 for Poisson).
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)


def test_the_run_offers_exactly_the_rate() -> None:
    # vLLM's rescale: the arrivals span exactly (n - 1) / rate, whatever the seed.
    for seed in range(5):
        offsets = arrival_offsets(24, 2.0, burstiness=0.5, seed=seed)
        assert offsets[-1] == pytest.approx(23 / 2.0)
        assert offsets == sorted(offsets)
    assert arrival_offsets(1, 2.0) == [0.0]


def test_burstier_means_more_spread() -> None:
    assert _gaps(5.0, 0.3).std() > _gaps(5.0, 1.0).std() > _gaps(5.0, 5.0).std()


def test_infinite_rate_and_determinism() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    assert arrival_offsets(10, 3.0, seed=1) == arrival_offsets(10, 3.0, seed=1)
    assert arrival_offsets(10, 3.0, seed=1) != arrival_offsets(10, 3.0, seed=2)
    assert arrival_offsets(0, 3.0) == []


def test_bad_rate() -> None:
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, burstiness=0.0)
