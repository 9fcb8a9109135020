"""MFU/MBU arithmetic: the cost model against torch's FLOP counter on the real
model, the attention estimate against a per-token count, the bytes formula, the
datasheet table and the CPU measurement; a tensor-parallel worker's peaks (all ranks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cost import attended_tokens, cost_model
from pdserve.engine.engine import LLMEngine
from pdserve.engine.results import StepInfo
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.observability import efficiency
from pdserve.observability.efficiency import DevicePeaks, detect_peaks, lookup_device, measure_peaks


def info_of(seqs: list[tuple[int, int]]) -> StepInfo:
    """StepInfo of sequences given as (tokens computed before, new tokens)."""
    return StepInfo(num_seqs=len(seqs), num_tokens=sum(n for _, n in seqs),
                    num_decode=sum(1 for _, n in seqs if n == 1),
                    context_tokens=sum(c + n for c, n in seqs), seconds=0.01)


def exact_attended(seqs: list[tuple[int, int]]) -> int:
    return sum(c + i for c, n in seqs for i in range(1, n + 1))


@pytest.mark.parametrize("seqs", [
    [(99, 1), (7, 1), (0, 1)],  # decode pool: all single tokens
    [(0, 300)],  # one fresh prompt
    [(256, 128)],  # a later chunk of a long prompt
    [(0, 64), (0, 64), (0, 64)],  # equal fresh prompts
])
def test_attended_tokens_exact_cases(seqs: list[tuple[int, int]]) -> None:
    assert attended_tokens(info_of(seqs)) == pytest.approx(exact_attended(seqs))


def test_attended_tokens_estimate_is_close_for_mixed_chunks() -> None:
    seqs = [(0, 100), (0, 60), (40, 1)]
    assert attended_tokens(info_of(seqs)) == pytest.approx(exact_attended(seqs), rel=0.25)


def test_cost_model_matches_torch_flop_counter(tiny_model: Callable[[str], Path]) -> None:
    """Every matmul of a real step (linear layers + LM head) is in the cost model."""
    # The reference linear path: torch's FLOP counter does not see oneDNN's kernels.
    engine = LLMEngine(tiny_model("llama-gqa"), EngineConfig(
        num_blocks=64, max_num_batched_tokens=40, linear_backend="torch"))
    engine.add_request("a", list(range(5, 55)), SamplingParams(max_tokens=3))
    engine.add_request("b", list(range(5, 25)), SamplingParams(max_tokens=3))
    cost = cost_model(engine.model_config, "float32")
    seen_decode = False
    while engine.has_unfinished():
        with FlopCounterMode(display=False) as counter:
            result = engine.step()
        info, outputs = result.info, result.outputs
        assert info is not None
        matmuls = sum(v for op, v in counter.get_flop_counts().get("Global", {}).items()
                      if str(op) in ("aten.mm", "aten.addmm"))
        attention = cost.attn_flops_per_pair * attended_tokens(info)
        assert cost.flops(info, len(outputs)) - attention == matmuls
        seen_decode |= info.num_decode == info.num_seqs
    assert seen_decode


def test_cost_model_formulas() -> None:
    mc = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16,
    })
    cost = cost_model(mc, "bfloat16")
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 256
    assert cost.linear_params_per_layer == per_layer
    info = info_of([(9, 1), (19, 1)])  # two decodes, contexts 10 and 20
    flops = 2 * 2 * per_layer * 2 + 2 * 64 * 1000 * 2 + 4 * 2 * 64 * 30
    assert cost.flops(info, 2) == flops
    kv_per_token = 2 * 2 * 32 * 2  # K+V, layers, kv width, bf16 bytes
    assert cost.bytes_read(info, 2) == (2 * per_layer + 64 * 1000) * 2 + kv_per_token * 30
    assert cost.bytes_read(info, 0) == 2 * per_layer * 2 + kv_per_token * 30  # no LM head


@pytest.mark.parametrize("name, flops, bw", [
    ("NVIDIA H100 80GB HBM3", 989e12, 3.35e12),
    ("NVIDIA H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA H200", 989e12, 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 2.039e12),
    ("NVIDIA B200", 2.25e15, 8.0e12),
])
def test_datasheet_table(name: str, flops: float, bw: float) -> None:
    peaks = lookup_device(name)
    assert peaks is not None and peaks.source == "datasheet"
    assert (peaks.flops_per_s, peaks.bytes_per_s) == (flops, bw)


def test_unknown_gpu_is_not_guessed() -> None:
    assert lookup_device("Tesla T4") is None


def test_cpu_measurement_is_positive() -> None:
    peaks = measure_peaks("cpu", budget_s=0.1, stream_bytes=16 << 20)
    assert peaks.flops_per_s > 1e8 and peaks.bytes_per_s > 1e8
    assert peaks.source == "measured" and str(torch.get_num_threads()) in peaks.device


def test_tensor_parallel_worker_peaks_cover_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step costs are the whole model's, which a worker's ranks share: the peaks
    MFU/MBU divide by are one rank's device times the ranks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert detect_peaks() == lookup_device("NVIDIA H200")
    two = detect_peaks(ranks=2)
    assert (two.flops_per_s, two.bytes_per_s) == (2 * 989e12, 2 * 4.8e12)
    assert (two.device, two.source, two.ranks) == ("NVIDIA H200", "datasheet", 2)
    # CPU: measured with this process's threads (one rank's), times the ranks.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one = DevicePeaks("cpu (1 threads)", 1e10, 2e10, "measured")
    monkeypatch.setattr(efficiency, "measure_peaks", lambda *a, **k: one)
    assert detect_peaks(ranks=3) == DevicePeaks("cpu (1 threads)", 3e10, 6e10, "measured", 3)
    with pytest.raises(ValueError, match="ranks"):
        one.times(0)
