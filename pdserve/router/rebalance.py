"""Rebalancing the decode pool by moving running requests (``router.rebalance``, off by
default: docs/migration.md). Every ``interval_s`` the router counts each decode worker's
running requests; one far above the pool's mean gives requests to the others -- each
moves with its KV (router/migration.py) to the worker the routing policy ranks first.

``plan`` is the rule, pure (the simulator can run it): a worker with more than
``ratio`` x the mean and at least ``min_excess`` requests above it gives half its
excess, rounded down. Hysteresis: a worker that gave sits out ``cooldown`` rounds, so
requests in flight between workers are not counted twice and nothing ping-pongs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

log = logging.getLogger("pdserve.router")


def plan(counts: Mapping[str, int], ratio: float, min_excess: int) -> dict[str, int]:
    """Worker id -> how many of its requests to move elsewhere (only those giving)."""
    if len(counts) < 2:
        return {}
    mean = sum(counts.values()) / len(counts)
    give = {}
    for wid, n in counts.items():
        excess = n - mean
        if n > ratio * mean and excess >= min_excess:
            give[wid] = int(excess // 2) or 1
    return give


class Rebalancer:
    def __init__(self, counts: Callable[[], dict[str, int]],
                 request_moves: Callable[[str, str, int], int], interval_s: float,
                 ratio: float, min_excess: int, cooldown: int = 3) -> None:
        """``counts``: the decode workers in routing and their running requests;
        ``request_moves(worker, reason, n)``: ask n of its attempts to move."""
        self._counts, self._request_moves = counts, request_moves
        self.interval_s, self.ratio, self.min_excess = interval_s, ratio, min_excess
        self.cooldown = cooldown
        self._resting: dict[str, int] = {}  # worker -> rounds left before it gives again

    def round(self) -> dict[str, int]:
        """One round: the moves asked for, per worker."""
        self._resting = {w: n - 1 for w, n in self._resting.items() if n > 1}
        asked = {}
        for wid, n in plan(self._counts(), self.ratio, self.min_excess).items():
            if wid in self._resting:
                continue
            asked[wid] = self._request_moves(wid, "rebalance", n)
            if asked[wid]:
                self._resting[wid] = self.cooldown
                log.info("rebalancing: %d request(s) move off %s", asked[wid], wid)
        return asked

    async def run(self) -> None:
        """A round every ``interval_s`` until cancelled (``Router`` owns the task)."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.round()
