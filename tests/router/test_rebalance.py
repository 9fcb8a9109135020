"""The decode pool's rebalancing rule (router/rebalance.py): who gives how many
requests, and the hysteresis that keeps moved requests from ping-ponging."""

from __future__ import annotations

from pdserve.router.rebalance import Rebalancer, plan


def test_a_worker_far_above_the_mean_gives_half_its_excess() -> None:
    assert plan({"d0": 10, "d1": 2}, ratio=1.5, min_excess=4) == {"d0": 2}
    assert plan({"d0": 12, "d1": 0, "d2": 0}, ratio=1.5, min_excess=4) == {"d0": 4}
    assert plan({"d0": 3, "d1": 0}, ratio=1.5, min_excess=1) == {"d0": 1}  # at least one


def test_nothing_moves_within_the_ratio_or_below_the_minimum_excess() -> None:
    assert plan({"d0": 7, "d1": 5}, ratio=1.5, min_excess=1) == {}  # 7 <= 1.5 x 6
    assert plan({"d0": 3, "d1": 0}, ratio=1.5, min_excess=4) == {}  # 1.5 above the mean
    assert plan({"d0": 40}, ratio=1.5, min_excess=1) == {}  # nowhere to go
    assert plan({}, ratio=1.5, min_excess=1) == {}


def test_a_worker_that_gave_sits_out_its_cooldown() -> None:
    asked: list[tuple[str, str, int]] = []

    def request_moves(worker: str, reason: str, n: int) -> int:
        asked.append((worker, reason, n))
        return n

    r = Rebalancer(lambda: {"d0": 10, "d1": 2}, request_moves, 1.0, 1.5, 4, cooldown=2)
    assert r.round() == {"d0": 2}
    assert r.round() == {}  # resting
    assert r.round() == {"d0": 2}  # the counts did not change: it gives again
    assert asked == [("d0", "rebalance", 2)] * 2


def test_a_worker_with_nothing_to_give_does_not_rest() -> None:
    r = Rebalancer(lambda: {"d0": 10, "d1": 2}, lambda w, why, n: 0, 1.0, 1.5, 4)
    assert r.round() == {"d0": 0}
    assert r.round() == {"d0": 0}  # asked again at once: none of its requests could move
