"""The simulator's engine is the real scheduler: its steps are the ones ``LLMEngine``
takes for the same requests, and a steady run is its single steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.sim.clock import EventLoop
from pdserve.sim.engine import EngineShape, SimEngine
from tests.engine.engines import engine, prompts

# (prompt length, max tokens): long prompts chunk, short ones decode beside them
REQUESTS = [(40, 12), (7, 30), (90, 5), (16, 20), (33, 1), (64, 25), (5, 40), (21, 9)]


def _engine_steps(path: Path, role: str, num_blocks: int) -> list[tuple[int, int, int, int]]:
    eng = engine(path, num_blocks=num_blocks, max_num_batched_tokens=48, max_num_seqs=5,
                 role=role)
    vocab = eng.model_config.vocab_size
    for i, (ids, (_, out)) in enumerate(zip(prompts(len(REQUESTS), [n for n, _ in REQUESTS],
                                                    vocab), REQUESTS, strict=True)):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=out, ignore_eos=True))
    shapes = []
    for _ in range(500):
        if not eng.has_unfinished():
            break
        info = eng.step().info
        if info is not None:
            shapes.append((info.num_seqs, info.num_tokens, info.num_decode, info.context_tokens))
    return shapes


def _sim_steps(role: str, num_blocks: int) -> list[tuple[int, int, int, int]]:
    sim = SimEngine(role, EngineShape(num_blocks, 16, 48, 5), EventLoop())
    for i, (n, out) in enumerate(REQUESTS):
        # unique blocks: random prompts share nothing
        sim.add(sim.new_request(f"r{i}", n, out, [hash((i, b)) & 0xFFFF for b in range(n // 16)]))
    shapes = []
    for _ in range(500):
        nxt = sim.schedule()
        if nxt is None:
            break
        batch, info = nxt
        shapes.append((info.num_seqs, info.num_tokens, info.num_decode, info.context_tokens))
        sim.complete(batch)
    return shapes


@pytest.mark.parametrize(("role", "num_blocks"), [("colocated", 256), ("colocated", 12),
                                                  ("prefill", 256)])
def test_the_same_steps_as_the_engine(tiny_model: Callable[[str], Path], role: str,
                                      num_blocks: int) -> None:
    """Chunked prefill, decodes beside prompts, the batch limits, preemption (12
    blocks cannot hold them all) and the prefill role's parking: step for step."""
    real = _engine_steps(tiny_model("llama-gqa"), role, num_blocks)
    assert real == _sim_steps(role, num_blocks)
    assert len(real) >= 5


def _decoding(n: int, k_blocks: int = 64) -> SimEngine:
    sim = SimEngine("decode", EngineShape(k_blocks, 16, 512, 8), EventLoop())
    for i in range(n):
        req = sim.new_request(f"d{i}", 10 + 7 * i, 60, [])
        assert sim.reserve(req) is not None
        sim.start_decode(req)
    return sim


def _state(sim: SimEngine) -> list[tuple[int, int, int, int]]:
    return [(r.num_tokens, r.num_computed_tokens, len(r.block_ids), r.num_registered_blocks)
            for r in sim.scheduler.running]


def test_a_steady_run_is_its_single_steps() -> None:
    one, many = _decoding(4), _decoding(4)
    k = many.steady_steps()
    assert k == 59  # the first token came from the prefill worker; the last ends them
    reqs = list(many.scheduler.running)
    assert many.decode_run(reqs, 20) == []
    for _ in range(20):
        nxt = one.schedule()
        assert nxt is not None and nxt[1].num_decode == 4
        one.complete(nxt[0])
    assert _state(one) == _state(many)
    assert one.pool.num_free == many.pool.num_free
    one.pool.check_integrity()
    many.pool.check_integrity()
    # the rest, whose last step finishes every request, as single steps finish them
    assert many.steady_steps() == 39
    assert many.decode_run(reqs, 39) == reqs
    ended = []
    for _ in range(39):
        nxt = one.schedule()
        assert nxt is not None
        ended += [r for r in one.complete(nxt[0]) if r.status is RequestStatus.FINISHED]
    assert [r.request_id for r in ended] == [r.request_id for r in reqs]
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason == "length"
               and r.num_output_tokens == 60 for r in reqs)
    assert not many.scheduler.running and many.pool.num_free == one.pool.num_free == 64


def test_no_steady_run_where_a_step_would_differ() -> None:
    sim = _decoding(3)
    sim.add(sim.new_request("waiting", 30, 5, []))
    assert sim.steady_steps() == 0  # a waiting prompt joins the next step
    tight = _decoding(4, k_blocks=8)  # 4 requests in 7 blocks: 1 free
    assert 0 < tight.steady_steps() < 16  # bounded by the free blocks
    assert tight.blocks_needed(tight.scheduler.running, tight.steady_steps()) <= tight.pool.num_free


def test_start_decode_of_a_one_token_request_ends_it() -> None:
    sim = SimEngine("decode", EngineShape(16, 16, 64, 4), EventLoop())
    req = sim.new_request("x", 20, 1, [])
    assert sim.reserve(req) is not None
    assert sim.start_decode(req)
    assert req.status is RequestStatus.FINISHED and sim.pool.num_free == 16


def test_a_prompts_last_token_is_not_a_decode_step() -> None:
    """A chunk that stops one token short of the prompt's end leaves a request one
    token behind, like a decoding one: but its next step samples its first token,
    which a steady run would not report as such."""
    sim = SimEngine("colocated", EngineShape(16, 16, 47, 4), EventLoop())
    req = sim.new_request("p", 48, 10, [])
    sim.add(req)
    nxt = sim.schedule()
    assert nxt is not None
    sim.complete(nxt[0])
    assert req.num_computed_tokens + 1 == req.num_tokens == 48
    assert sim.steady_steps() == 0
