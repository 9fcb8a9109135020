"""The engine tests' fixtures: the device they run on and the backends they run on."""

from __future__ import annotations

import pytest

from pdserve.engine import kernels
from tests.engine.engines import BACKENDS, DEVICE


@pytest.fixture(autouse=True)
def _on_device(device: str) -> None:
    DEVICE["name"] = device


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, device: str) -> str:
    """Every engine behaviour is checked on the reference and on the C++ kernels
    (on a GPU: the reference backends, on CUDA)."""
    if request.param == "cpu" and (device != "cpu" or kernels.cpu_supported() is not None):
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    return str(request.param)
