"""Weight-only quantization end to end: GGUF blocks served natively, quantized
checkpoints, both kernels against the dequantize reference, bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine import kernels
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
needs_kernels = pytest.mark.skipif(kernels.cpu_supported() is not None,
                                   reason=str(kernels.cpu_supported()))


def engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{"num_blocks": 256, **kw}))  # type: ignore[arg-type]


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length + 7 * i,), generator=g).tolist() for i in range(n)]


@needs_kernels
@pytest.mark.parametrize(("kind", "group"), [("int8", 32), ("int4", 32), ("int4", 64)])
def test_quantized_kernels_match_dequantize_reference(tiny_model: Callable[[str], Path],
                                                      kind: str, group: int) -> None:
    """Batch 1 (streaming kernel) and 32 (widened BLAS path) on both backends."""
    path = tiny_model("llama-gqa")  # sizes 64 / 192: multiples of the groups
    kw = {"quantization": kind, "quantization_group_size": group}
    ref = engine(path, linear_backend="torch", attention_backend="torch", **kw)
    fast = engine(path, linear_backend="cpu", attention_backend="cpu", **kw)
    for n in (1, 32):
        ps = prompts(n, 20, seed=n)
        assert [o.token_ids for o in fast.generate(ps, GREEDY)] == \
            [o.token_ids for o in ref.generate(ps, GREEDY)]


@needs_kernels
@pytest.mark.slow
def test_default_model_int4_serves_the_gguf_blocks(default_model_dir: Path) -> None:
    q = engine(default_model_dir, quantization="int4", num_threads=1)
    assert q.quant_report is not None
    assert not q.quant_report.quantized  # every matrix straight from the Q4_1 / Q8_0 blocks
    assert len(q.quant_report.native) == 4 * q.model_config.num_layers + 1
    tok = q.tokenizer
    assert tok is not None
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    ps = [tok.encode(t) for t in texts]
    want = engine(default_model_dir, num_threads=1).generate(ps, GREEDY)
    got = q.generate(ps, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_bad_quantization_settings_are_clear_errors(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="not a multiple of the quantization group size 128"):
        engine(tiny_model("llama-gqa"), quantization="int4", quantization_group_size=128)
