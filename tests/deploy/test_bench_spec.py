"""bench_spec's peer server: a llama-server that dies at start says how it died."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdserve.deploy.bench_spec import _llama_server


def test_a_llama_server_killed_at_start_is_named_with_its_signal(tmp_path: Path) -> None:
    # llama.cpp's native (-DGGML_NATIVE=ON) build dies with SIGILL on a CPU whose
    # instructions it uses without asking (AMX tiles on the AMX class): say so.
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho loading model\nkill -ILL $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with (pytest.raises(RuntimeError, match=r"did not start \(killed by SIGILL\)") as err,
          _llama_server(str(fake), tmp_path / "model.gguf", 1, [])):
        pass
    assert "loading model" in str(err.value)


def test_a_llama_server_that_exits_at_start_is_named_with_its_code(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho no such model\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with (pytest.raises(RuntimeError, match=r"did not start \(exit code 3\)"),
          _llama_server(str(fake), tmp_path / "model.gguf", 1, [])):
        pass
