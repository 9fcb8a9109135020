"""benchmarks.moves' client-side figures: the gaps around a move, from the chunks'
arrival times."""

from __future__ import annotations

import pytest

from benchmarks.moves import chunk_times, gaps
from pdserve.client.openai_stream import RequestOutput


def stream(start: float, ttft: float, itl: list[float]) -> RequestOutput:
    return RequestOutput(success=True, start_time=start, ttft=ttft, itl=itl)


def test_the_longest_gap_in_the_move_against_the_median_gap_before_it() -> None:
    # chunks at 1, 2, 3, 4 | move window [4.5, 6] | 7 (a 3 s gap across it), 8
    a = stream(0.0, 1.0, [1.0, 1.0, 1.0, 3.0, 1.0])
    # chunks at 1.5, 2.5 | 5.0 (a 2.5 s gap into the window), 5.5 | 6.5, 7.5
    b = stream(0.5, 1.0, [1.0, 2.5, 0.5, 1.0, 1.0])
    assert chunk_times(a) == [1.0, 2.0, 3.0, 4.0, 7.0, 8.0]
    figures = gaps([a, b], 4.5, 6.0)
    assert figures["median_gap_before_s"] == 1.0  # 1, 1, 1 and 1: the gaps ended by 4.5
    assert figures["longest_gap_in_move_s"] == 3.0
    assert figures["ratio"] == 3.0
    assert figures["worst_five"][0] == (3.0, pytest.approx(-0.5))  # began before the call
    assert figures["streams_longest_gap_p50_s"] == 3.0  # of (3.0, 2.5): the upper one
