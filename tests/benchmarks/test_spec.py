"""bench_spec: its peer server (a llama-server that dies at start says how it died), its
measure of what verifying drafts costs, and its sustained load."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.spec_engine import sustained_load, verification_cost
from benchmarks.spec_served import _llama_server
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer


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


def test_verification_cost_times_steps_whose_drafts_were_all_accepted(
        tiny_model: Callable[[str], Path]) -> None:
    """Each batch size's verifying steps have every request's k drafted tokens (its
    prediction is its own output): steps of exactly batch x (k + 1) rows were found and
    timed (the median of none would raise), and the break-even follows from the ratio."""
    path = tiny_model("llama-gqa")
    prompts = [[5 + (i * 7 + j) % 90 for j in range(6 + 5 * i)] for i in range(3)]
    got = verification_cost(path, Tokenizer.from_dir(path), 1, [1, 3], 3, prompts, 1)
    assert set(got) == {1, 3}
    for row in got.values():
        assert row["plain_ms"] > 0 and row["verify_ms"] > 0
        assert row["ratio"] == pytest.approx(row["verify_ms"] / row["plain_ms"])
        assert row["break_even_acceptance"] == pytest.approx((row["ratio"] - 1) / 3)


def test_sustained_load_counts_only_steps_with_every_stream_in_flight(
        tiny_model: Callable[[str], Path]) -> None:
    """2 streams, 5 requests of exactly 3 tokens: two at a time finish together, so the
    window is 6 steps, 12 tokens and 4 finished requests; the fifth, alone (fewer than
    2 in flight), is not counted, and is aborted: the engine is left empty."""
    path = tiny_model("llama-gqa")
    eng = LLMEngine(path, EngineConfig(dtype="float32", num_threads=1),
                    tokenizer=Tokenizer.from_dir(path))
    prompts = [[5 + (i * 7 + j) % 90 for j in range(6 + 5 * i)] for i in range(3)]
    got = sustained_load(eng, prompts, 2, 5, SamplingParams(max_tokens=3, ignore_eos=True))
    assert (got.tokens, got.steps, got.finished) == (12, 6, 4)
    assert got.rate == pytest.approx(12 / got.seconds)
    assert not eng.has_unfinished()
    eng.check_integrity()
