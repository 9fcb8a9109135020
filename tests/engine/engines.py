"""Helpers the engine tests share: random prompts, a plain engine on the test's device,
the backends every engine behaviour is checked on."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams

GREEDY48 = SamplingParams(max_tokens=48, ignore_eos=True)
BACKENDS = ["torch", "cpu"]


def prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


DEVICE = {"name": "cpu"}  # --device (scripts/gpu_check.sh runs these tests on CUDA)


def engine(path: Path, backend: str = "auto", **kw: object) -> LLMEngine:
    cfg = {"num_blocks": 256, "attention_backend": backend, "linear_backend": backend,
           "device": DEVICE["name"], **kw}
    return LLMEngine(path, EngineConfig(**cfg))  # type: ignore[arg-type]
