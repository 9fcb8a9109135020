"""Helpers the speculative-decoding tests share (test_spec_decode.py, test_draft_model.py):
an engine that speculates, a two-rank one, prompts worth drafting from, a run that
checks every block came back, a grammar to speculate within."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.worker.tensor_parallel import create_engine
from tests.engine.engines import prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def engine(path: Path, backend: str = "cpu", spec: dict[str, object] | None = NGRAM,
           **kw: object) -> LLMEngine:
    cfg = {"num_blocks": 256, "attention_backend": backend, "linear_backend": backend,
           "speculative_config": spec, **kw}
    return LLMEngine(path, EngineConfig(**cfg))  # type: ignore[arg-type]


@contextlib.contextmanager
def tp_engine(path: Path, spec: dict[str, object]) -> Iterator[LLMEngine]:
    """A two-rank engine (torch kernels) speculating with ``spec``; on leaving, one
    more request checks that the ranks are still in step, then it closes."""
    eng = create_engine(path, EngineConfig(
        num_blocks=128, attention_backend="torch", linear_backend="torch", num_threads=1,
        tensor_parallel_size=2, speculative_config=spec))  # type: ignore[arg-type]
    try:
        yield eng
        eng.add_request("after", [5, 6, 7], SamplingParams(max_tokens=3))
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.close()


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random span: a draft from the prompt has something to match."""
    return [p * 3 + p[:5] for p in prompts(n, [11, 17, 9], 500, seed=seed)]


def run_checked(eng: LLMEngine, ps: list[list[int]],
                params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    out = [c.token_ids for c in eng.generate(ps, params)]
    eng.check_integrity()
    assert eng.pool.num_used == 0 and not eng.requests
    return out


SENTENCES = StructuredOutput.regex(r"(the cat sat on the mat\. ){3,8}")
