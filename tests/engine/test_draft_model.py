"""Draft-model speculation (engine/draft_model.py): a draft of the same tokenizer
proposes greedily with its own paged KV; the output is the target's token for token
(greedy and seeded sampling, preemption, hand-off), rejected tokens' draft KV is cut
back, and every draft block is free once the requests are gone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.handoff import decode_to_end, disaggregate
from tests.engine.test_spec_decode import GREEDY, _run, copy_prompts, engine
from tests.engine.test_spec_decode import backend as backend


def draft(path: Path, k: int = 4, **kw: object) -> dict[str, object]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **kw}


def drained(eng: LLMEngine) -> None:
    assert eng.draft is not None
    eng.check_integrity()
    assert eng.draft.pool.num_used == 0 and not eng.draft.mirrors


def test_a_draft_equal_to_the_target_is_accepted_and_changes_nothing(
        tiny_model: Callable[[str], Path], backend: str) -> None:
    """The target as its own draft: the draft's KV (its prompt caught up in chunks,
    then cut back after every partly rejected draft) must match the target's, so
    almost every draft token is accepted -- a draft cache that went wrong would not
    be."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=4)
    want = _run(engine(path, backend, spec=None), ps, GREEDY)
    eng = engine(path, backend, spec=draft(path), max_num_batched_tokens=64)
    assert _run(eng, ps, GREEDY) == want
    stats = eng.stats().spec
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
    drained(eng)


def test_a_smaller_draft_keeps_greedy_and_seeded_output(tiny_model: Callable[[str], Path],
                                                         backend: str) -> None:
    """A different (2-layer, other weights) draft: most guesses are wrong, so its
    cache is cut back nearly every step; the tokens stay the target's."""
    path, small = tiny_model("llama-gqa"), tiny_model("llama-mha")
    ps = copy_prompts(3, seed=6)
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=20, seed=s,
                             ignore_eos=True) for s in (1, 2, 3)]
    for p in (GREEDY, params):
        want = _run(engine(path, backend, spec=None), ps, p)
        eng = engine(path, backend, spec=draft(small))
        assert _run(eng, ps, p) == want
        stats = eng.stats().spec
        assert stats is not None and stats.num_drafts > 0
        assert stats.num_accepted_tokens < stats.num_draft_tokens
        drained(eng)


def test_every_draft_is_the_draft_models_own_greedy_continuation(
        tiny_model: Callable[[str], Path]) -> None:
    """What the draft proposes from its cache (cut back after rejections, caught up
    on corrections, several requests batched) is what the draft model alone makes of
    the request's tokens, greedily: a stale or misplaced KV row would change it."""
    path, small = tiny_model("llama-gqa"), tiny_model("llama-mha")
    eng = engine(path, spec=draft(small, 5), dtype="float32")
    assert eng.draft is not None
    calls: list[tuple[list[int], list[int]]] = []
    propose = eng.draft.propose

    def recorded(wanted: list[tuple[Request, int]]) -> list[list[int]]:
        out = propose(wanted)
        calls.extend((list(r.token_ids), d) for (r, _), d in zip(wanted, out, strict=True))
        return out

    eng.draft.propose = recorded  # type: ignore[method-assign]
    _run(eng, copy_prompts(3, seed=8), GREEDY)
    stats = eng.stats().spec
    assert stats is not None and stats.num_accepted_tokens < stats.num_draft_tokens
    alone = engine(small, spec=None, dtype="float32")
    checked = calls[:: max(1, len(calls) // 12)]
    assert len(checked) >= 6
    for tokens, d in checked:
        assert d and _run(alone, [tokens], SamplingParams(max_tokens=len(d), ignore_eos=True))[0] == d


def test_preemption_aborts_and_tight_draft_blocks(tiny_model: Callable[[str], Path]) -> None:
    """Few blocks: the target preempts, and the draft's cache (as many blocks) runs out
    too -- its least recently used mirrors are dropped and caught up again. An abort
    in mid-speculation gives the draft's blocks back."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(6, seed=7)
    want = _run(engine(path, spec=None), ps, GREEDY)
    eng = engine(path, spec=draft(path, disable_by_batch_size=64), num_blocks=22, block_size=8)
    assert _run(eng, ps, GREEDY) == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    drained(eng)
    eng.add_request("a", ps[0], GREEDY)
    while eng.draft is not None and not eng.draft.mirrors:
        eng.step()
    eng.abort("a")
    drained(eng)


def test_decode_worker_drafts_from_its_first_step(tiny_model: Callable[[str], Path]) -> None:
    """Disaggregated: the prefill worker never loads the draft; the decode worker
    computes its draft's prompt itself on the first step and speculates from there."""
    path = tiny_model("llama-gqa")
    prompt = copy_prompts(1, seed=11)[0]
    want = _run(engine(path, spec=None), [prompt], GREEDY)[0]
    prefill = engine(path, spec=draft(path), role="prefill")
    assert prefill.draft is None
    decode = engine(path, spec=draft(path), role="decode", num_blocks=64)
    first = disaggregate(prefill, decode, "r", prompt, GREEDY)
    tokens, steps = decode_to_end(decode)
    assert [first, *tokens] == want
    assert steps < (len(want) - 1) / 2  # the target as draft: most steps give 2+ tokens
    drained(decode)
    assert decode.pool.num_used == 0


def test_draft_model_config_is_checked(tiny_model: Callable[[str], Path],
                                       tmp_path: Path) -> None:
    path = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig(method="ngram", model=str(path))
    with pytest.raises(ValueError, match="not found"):
        engine(path, spec=draft(tmp_path / "none"))
    other = tmp_path / "other-vocab"
    shutil.copytree(path, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 8}))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        engine(path, spec=draft(other))
    short = tmp_path / "short"
    shutil.copytree(path, short)
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="fewer than the target's max_model_len"):
        engine(path, spec=draft(short))
