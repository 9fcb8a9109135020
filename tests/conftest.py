"""Shared fixtures: tiny random-weight checkpoints made once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.inprocess import Pair


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu",
                     help="device for the engine tests (scripts/gpu_check.sh passes cuda)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU and the kernel families it runs: a failure's report names the class."""
    import os
    import platform

    import torch

    from pdserve.engine import kernels
    from pdserve.engine.model.attention import attention_families
    from pdserve.engine.model.linear import cpu_families

    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.machine())
    hidden = os.environ.get(kernels.HIDE_FLAGS_ENV, "")
    runs = ("kernels: " + (kernels.reason() or "built") if not kernels.available() else
            f"families: linear bf16 {cpu_families(torch.bfloat16)}, attention "
            f"{attention_families('bfloat16')}")
    return [f"cpu: {model}, {torch.get_num_threads()} torch threads"
            + (f", hiding {hidden!r}" if hidden else ""), runs]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(preset)`` -> directory of a tiny checkpoint (made on first use),
    named ``tiny``: the model's served name (a router refuses workers of another)."""
    from pdserve.engine.model.tiny import make_tiny

    made: dict[str, Path] = {}

    def get(preset: str = "llama-gqa") -> Path:
        if preset not in made:
            made[preset] = make_tiny(tmp_path_factory.mktemp(preset) / "tiny", preset=preset,
                                     seed=0)
        return made[preset]

    return get


@pytest.fixture
def free_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model's cost taken as nothing, so it drafts at every step its adaptive
    length allows. The engine measures that cost in wall-clock time, and a tiny draft
    costs about what its tiny target does: on a slower machine it stops paying and
    pauses, and which steps draft would vary with the machine. Tests of what drafting
    does need the same steps to draft everywhere."""
    from pdserve.engine.engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "_draft_cost", lambda self: 0.0)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct (``make test`` prepares it first)."""
    from pdserve.engine.model.gguf_convert import prepare_default_model

    return prepare_default_model(progress=False)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One embedded Ray cluster (loopback only) shared by every test that needs Ray."""
    import ray

    from pdserve.cluster.cluster import init_local_ray

    init_local_ray(num_cpus=4)
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


@pytest.fixture
def pair_factory(tiny_model: Callable[[str], Path]) -> Iterator[Callable[..., Pair]]:
    """``pair_factory(**kw)`` -> a ``tests.inprocess.Pair`` (closed, and checked for
    leaked blocks, after the test)."""
    from tests.inprocess import Pair

    made: list[Pair] = []

    def make(**kw: object) -> Pair:
        made.append(Pair(tiny_model("llama-gqa"), **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for p in made:
        p.close()
