"""The fuzz suite's server: a real router over tiny in-process prefill and decode
workers (local transfer), its HTTP and gRPC front doors on loopback port 0 with
an API key, all on one event loop in a thread of its own so that synchronous
clients (schemathesis' requests, grpc's blocking stubs) can drive it.

Bounds: the served context is `CONTEXT` tokens, so no request, however generated,
decodes for long; every call has a client-side deadline (`CALL_TIMEOUT_S`) that
only a hang reaches. At the end of the session every worker's blocks must all be
free again and its pool must pass its integrity check (``Pair.close``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.live_server import LiveServer

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
CONTEXT = 64  # tokens: prompt + output of any one request


@dataclass
class FuzzStats:
    """Cases tried and answers seen, per suite (printed at the end of the run)."""

    cases: Counter[str] = field(default_factory=Counter)
    answers: dict[str, Counter[str]] = field(default_factory=dict)

    def record(self, suite: str, answer: str) -> None:
        self.cases[suite] += 1
        self.answers.setdefault(suite, Counter())[answer] += 1

    def lines(self) -> list[str]:
        return [f"{suite}: {n} cases; answers {dict(sorted(self.answers[suite].items()))}"
                for suite, n in sorted(self.cases.items())]


STATS = FuzzStats()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STATS.cases:
        terminalreporter.section("fuzz cases")
        for line in STATS.lines():
            terminalreporter.write_line(line)


@pytest.fixture(scope="package")
def live(tiny_model: Callable[[str], Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_model("llama-gqa"), context=CONTEXT, api_keys=[KEY]) as server:
        yield server


@pytest.fixture(scope="package")
def grpc_channel(live: LiveServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(live.grpc_target) as channel:
        yield channel
