"""The simulation's event loop: callbacks on a virtual clock, in time order (ties in
the order they were scheduled), so a run is deterministic."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

_FIRST = 1 << 62  # ``due`` events' order keys lie below every ``at`` event's


class Event:
    __slots__ = ("args", "cancelled", "fn", "time")

    def __init__(self, time: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.time, self.fn, self.args, self.cancelled = time, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def clock(self) -> float:
        """The virtual time: what the real code's injectable clocks read."""
        return self.now

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Event:
        return self._push(time, next(self._seq), fn, args)

    def due(self, time: float, rank: int, fn: Callable[..., Any], *args: Any) -> Event:
        """An event known from the start (the workload's ``rank``-th arrival), added
        when it is next: it runs before every other event of the same time, and in
        ``rank`` order among its kind, as if all were added before the run began
        (which would keep a heap of every arrival)."""
        return self._push(time, rank - _FIRST, fn, args)

    def _push(self, time: float, order: int, fn: Callable[..., Any],
              args: tuple[Any, ...]) -> Event:
        if time < self.now:
            raise ValueError(f"event at {time} is before now ({self.now})")
        ev = Event(time, fn, args)
        heapq.heappush(self._heap, (time, order, ev))
        return ev

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Event:
        return self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, max_events: int | None = None) -> None:
        """Until no event is left (or ``max_events`` ran: a bound on a runaway model)."""
        heap = self._heap
        while heap:
            if max_events is not None and self.events_run >= max_events:
                raise RuntimeError(f"simulation stopped after {max_events} events at "
                                   f"t={self.now:.3f} s with {len(heap)} pending")
            t, _, ev = heapq.heappop(heap)
            if ev.cancelled:
                continue
            self.now = t
            self.events_run += 1
            ev.fn(*ev.args)
