"""``pdserve simulate``: bench's flags and result JSON, serve's deployment flags and
YAML, and a clear error for what cannot be simulated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli.main import _cluster_config, build_parser, main
from pdserve.planner.step_times import Profile
from pdserve.sim.cli import step_source

GPU = ["simulate", "--hardware", "h100", "--model", "llama-3-8b", "--num-prompts", "40",
       "--random-input-len", "512", "--random-output-len", "32", "--request-rate", "10"]


def test_the_result_json_is_the_benchs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*GPU, "--prefill-workers", "2", "--decode-workers", "1", "--goodput",
                 "ttft:200", "tpot:20", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "sim.json", "--metric-percentiles", "50,90"])
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "simulated" in out
    saved = json.loads((tmp_path / "sim.json").read_text())
    assert saved["completed"] == 40 and saved["backend"] == "pdserve-simulate"
    for key in ("p90_ttft_ms", "median_tpot_ms", "request_goodput", "itls", "input_lens"):
        assert key in saved
    assert saved["simulation"]["deployment"].startswith("2 prefill, 1 decode")


def test_a_sweep_and_a_yaml_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "pd.yaml"
    cfg.write_text("prefill: {workers: 1, tensor_parallel_size: 2}\n"
                   "decode: {workers: 2}\nrouter: {policy: round_robin}\n")
    assert main([*GPU, "--config", str(cfg), "--sweep-rates", "5,20"]) == 0
    out = capsys.readouterr().out
    assert "1 prefill (TP 2), 2 decode" in out
    assert out.count("Serving Benchmark Result") == 2


def test_a_measured_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile(model="tiny", device="cpu", dtype="float32", quantization="none", threads=1,
                   prefill_coef=(2.0, 0.05, 1e-5), decode_coef=(3.0, 0.2, 1e-4),
                   kv_bytes_per_token=4096, kv_tokens=65536)
    path = prof.save(tmp_path / "p.json")
    code = main(["simulate", "--profile", str(path), "--num-prompts", "20",
                 "--random-input-len", "128", "--random-output-len", "16",
                 "--colocated-workers", "1", "--prefill-workers", "0", "--decode-workers", "0"])
    assert code == 0
    assert "link" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    ([], "give --profile FILE"),
    (["--hardware", "h100", "--model", "nope"], "neither a preset"),
    (["--hardware", "tpu9", "--model", "llama-3-8b"], "unknown hardware"),
    (["--hardware", "h100", "--model", "llama-3-70b"], "does not fit"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--random-input-len", "9000"],
     "exceed --max-model-len"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--prefill-workers", "0",
      "--decode-workers", "0"], "no workers"),
])
def test_bad_input_is_one_clear_error(extra: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--num-prompts", "4", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_profile_cannot_simulate_tensor_parallel_pools(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile("tiny", "cpu", "float32", "none", 1, (1.0, 0.1, 0.0), (1.0, 0.1, 0.0), 64, 4096)
    path = prof.save(tmp_path / "p.json")
    assert main(["simulate", "--profile", str(path), "--prefill-tensor-parallel-size", "2"]) == 2
    assert "tensor-parallel" in capsys.readouterr().err


def test_each_pool_steps_as_the_profile_of_its_threads(tmp_path: Path) -> None:
    paths = []
    for threads in (1, 2):
        prof = Profile("tiny", "cpu", "float32", "none", threads, (threads, 0.1, 0.0),
                       (threads, 0.1, 0.0), 64, 4096)
        paths.append(str(prof.save(tmp_path / f"t{threads}.json")))
    args = build_parser().parse_args(["simulate", "--profile", paths[0], "--profile", paths[1],
                                      "--colocated-workers", "1"])
    cluster = _cluster_config(args)
    steps_for, device, _, _ = step_source(args, cluster)
    assert device == "cpu"
    assert steps_for(cluster.prefill).threads == 1  # type: ignore[attr-defined]
    assert steps_for(cluster.colocated_pool).threads == 2  # type: ignore[attr-defined]
    three = cluster.prefill.__class__(num_cpus=3)
    with pytest.raises(ValueError, match=r"no profile of 3 thread\(s\)"):
        steps_for(three)


def test_overheads_reach_the_latencies(capsys: pytest.CaptureFixture[str]) -> None:
    def ttft(extra: list[str]) -> float:
        assert main([*GPU, "--num-prompts", "5", "--request-rate", "1", *extra]) == 0
        out = capsys.readouterr().out
        return float(next(line.split()[-1] for line in out.splitlines()
                          if line.startswith("Mean TTFT")))

    base = ttft(["--overheads-ms", "request=0,call=0,token=0,step=0"])
    slow = ttft(["--overheads-ms", "request=100"])
    assert slow == pytest.approx(base + 100, abs=5)
    assert main([*GPU, "--overheads-ms", "request=fast"]) == 2
    assert "not a number" in capsys.readouterr().err


def test_step_time_scale_per_kind(capsys: pytest.CaptureFixture[str]) -> None:
    def means(extra: list[str]) -> tuple[float, float]:
        assert main([*GPU, "--num-prompts", "5", "--request-rate", "1", "--overheads-ms",
                     "request=0,call=0,token=0,step=0", *extra]) == 0
        lines = capsys.readouterr().out.splitlines()

        def mean(name: str) -> float:
            return float(next(x.split()[-1] for x in lines if x.startswith(f"Mean {name}")))

        return mean("TTFT"), mean("TPOT")

    ttft, tpot = means([])
    slow_prompts = means(["--step-time-scale", "prefill=2"])
    assert slow_prompts[0] == pytest.approx(2 * ttft, rel=0.05)
    assert slow_prompts[1] == pytest.approx(tpot, rel=0.05)  # (local prefills slow decodes)
    both = means(["--step-time-scale", "1.5"])
    assert both[1] == pytest.approx(1.5 * tpot, rel=0.01)
    for bad in ("fast", "prefill=0", "middle=2"):
        assert main([*GPU, "--step-time-scale", bad]) == 2
        assert "--step-time-scale" in capsys.readouterr().err
