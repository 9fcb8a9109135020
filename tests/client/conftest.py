"""Client test fixtures: the tiny model's tokenizer and the fake streaming server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.client.tokens import PromptTokenizer
from tests.client.fake_server import FakeConfig, FakeServer


@pytest.fixture(scope="session")
def tiny_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama-gqa")


@pytest.fixture(scope="session")
def prompt_tok(tiny_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_dir)


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """``fake_server(**FakeConfig fields)`` -> a started server, stopped after the test."""
    started: list[FakeServer] = []

    def make(**kwargs: object) -> FakeServer:
        server = FakeServer(FakeConfig(**kwargs)).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
