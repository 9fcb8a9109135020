"""Draft-model speculation (engine/spec/draft_model.py): a draft of the same tokenizer
proposes with its own paged KV, sampling as the target will (the request's parameters
and the draws verification makes next); the output is the target's token for token
(greedy and seeded sampling, preemption, hand-off) and unseeded sampling keeps its
distribution, rejected tokens' draft KV is cut back, and every draft block is free
once the requests are gone."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model.linear import CpuQuantized, Linear, TorchQuantized
from pdserve.engine.request import Request
from pdserve.engine.sampling.sampler import SamplingRow
from pdserve.engine.sampling.sampling_params import SamplingParams
from tests.engine.handoff import decode_to_end, disaggregate
from tests.engine.spec_helpers import (
    GREEDY,
    SENTENCES,
    copy_prompts,
    engine,
    run_checked,
    tp_engine,
)

pytestmark = pytest.mark.usefixtures("free_draft")
measured_cost = LLMEngine._draft_cost  # the engine's own (free_draft replaces it)


def draft(path: Path | str, k: int = 4, **kw: object) -> dict[str, object]:
    """A draft model's config that drafts at any batch (its default limit is 2 running
    requests): these tests batch several mirrors in a step."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "disable_by_batch_size": 64, **kw}


def drained(eng: LLMEngine) -> None:
    assert eng.draft is not None
    eng.check_integrity()
    assert eng.draft.pool.num_used == 0 and not eng.draft.mirrors


def test_a_draft_equal_to_the_target_is_accepted_and_changes_nothing(
        tiny_model: Callable[[str], Path], backend: str, tmp_path: Path) -> None:
    """The target's weights as a draft (a copy of its checkpoint elsewhere, which the
    draft computes the KV of itself): the draft's KV (its prompt caught up in chunks,
    then cut back after every partly rejected draft) must match the target's, so
    almost every draft token is accepted -- a draft cache that went wrong would not
    be."""
    path = tiny_model("llama-gqa")
    twin = tmp_path / "twin"
    shutil.copytree(path, twin)
    ps = copy_prompts(3, seed=4)
    want = run_checked(engine(path, backend, spec=None), ps, GREEDY)
    eng = engine(path, backend, spec=draft(twin), max_num_batched_tokens=64)
    assert eng.draft is not None and eng.draft.target_kv is None
    assert run_checked(eng, ps, GREEDY) == want
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
        want = run_checked(engine(path, backend, spec=None), ps, p)
        eng = engine(path, backend, spec=draft(small))
        assert run_checked(eng, ps, p) == want
        stats = eng.stats().spec
        assert stats is not None and stats.num_drafts > 0
        assert stats.num_accepted_tokens < stats.num_draft_tokens
        drained(eng)


def test_the_targets_own_int4_copy_drafts(tiny_model: Callable[[str], Path],
                                          backend: str) -> None:
    """``speculative_config.quantization``: the target's own checkpoint loaded in int4
    is its draft (every linear layer quantized, the target's not): its guesses are
    close, so many are accepted, and the tokens stay the unquantized target's."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=4)
    want = run_checked(engine(path, backend, spec=None), ps, GREEDY)
    eng = engine(path, backend, spec=draft(path, quantization="int4"))
    assert eng.draft is not None and eng.draft.model_id.endswith(" (int4)")
    def quantized(model: torch.nn.Module) -> list[bool]:
        return [isinstance(m.kernel, (CpuQuantized, TorchQuantized)) for m in model.modules()
                if isinstance(m, Linear)]

    assert all(quantized(eng.draft.model)) and not any(quantized(eng.model))
    assert run_checked(eng, ps, GREEDY) == want
    stats = eng.stats().spec
    assert stats is not None and stats.num_drafts > 0
    # A random tiny model's logits are nearly flat, so int4's rounding flips its argmax
    # far more often than the default model's (23 of 64 here, where a draft of other
    # weights gets none accepted)
    assert stats.num_accepted_tokens >= 0.25 * stats.num_draft_tokens, stats
    assert measured_cost(eng) > 0  # measured: what a draft token costs caps its length
    drained(eng)


def test_the_default_models_int4_copy_drafts_most_of_its_tokens(default_model_dir: Path) -> None:
    """The default model in bfloat16 drafted by its own GGUF's Q4_1 blocks, named as
    ``--model`` names it: an open question (nothing to copy) keeps the target's tokens,
    and the draft guesses most of them."""
    from pdserve.engine.model.gguf_convert import DEFAULT_MODEL_NAME
    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain how rainbows form."}])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    kw = {"dtype": "bfloat16", "num_threads": 2, "max_model_len": 1024}
    want = run_checked(engine(default_model_dir, spec=None, **kw), [prompt], params)
    eng = engine(default_model_dir, spec=draft(DEFAULT_MODEL_NAME, k=3, quantization="int4"),
                 **kw)
    assert run_checked(eng, [prompt], params) == want
    stats = eng.stats().spec
    assert stats is not None and stats.num_accepted_tokens >= 0.7 * stats.num_draft_tokens, stats
    drained(eng)


def test_the_targets_own_checkpoint_copies_the_targets_kv(tiny_model: Callable[[str], Path],
                                                         tmp_path: Path) -> None:
    """A draft from the target's own directory takes the KV of the tokens the target
    computed from the target's cache: colocated, its first step computes one token
    (not the prompt again); on a prefill engine its prompt KV is the target's blocks,
    computed by no draft forward; handed over, the decode engine drafts from it. The
    tokens stay the target's without speculation."""
    path = tiny_model("llama-gqa")
    prompt = copy_prompts(1, seed=11)[0]
    want = run_checked(engine(path, spec=None), [prompt], GREEDY)[0]
    spec = draft(path, quantization="int4")
    eng = engine(path, spec=spec)
    assert eng.draft is not None and eng.draft.target_kv is eng.kv_cache
    computed: list[int] = []
    run = eng.draft._run

    def counted(work: list[tuple[Request, int]], rows: dict[str, SamplingRow]) -> dict[str, int]:
        computed.append(sum(n for _, n in work))
        return run(work, rows)

    eng.draft._run = counted  # type: ignore[method-assign]
    assert run_checked(eng, [prompt], GREEDY) == [want]
    assert computed[0] == 1, computed[:3]
    drained(eng)
    # prefill role: asked for the draft's prompt KV (by a decode pool that computes
    # its own draft's, e.g. under tensor parallelism), it copies the target's blocks
    prefill = engine(path, spec=spec, role="prefill")
    assert prefill.draft is not None
    prefill.draft._run = None  # type: ignore[assignment,method-assign]  # never called
    prefill.add_request("p", prompt, GREEDY)
    while not prefill.step().outputs:
        pass
    prefill.prefill_draft(["p"])
    blocks = torch.tensor(prefill.block_ids("p"))
    assert torch.equal(prefill.draft.kv_cache[blocks], prefill.kv_cache[blocks])
    prefill.release("p")
    # decode role: it reserves no draft blocks (no draft KV travels) and copies the
    # target's prompt KV, handed over, at its first draft
    prefill = engine(path, spec=spec, role="prefill")
    decode = engine(path, spec=spec, role="decode", num_blocks=64)
    assert decode.draft is not None
    decode.reserve("q", prompt, GREEDY)
    assert decode.reserve_draft("q") == [] and not decode.draft.mirrors
    decode.abort("q")
    computed.clear()
    run = decode.draft._run
    decode.draft._run = counted  # type: ignore[method-assign]
    first = disaggregate(prefill, decode, "r", prompt, GREEDY)
    tokens, _ = decode_to_end(decode)
    assert [first, *tokens] == want and computed[0] == 1, computed[:3]
    assert decode.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    drained(decode)


def test_pools_whose_drafts_load_differently_name_it(tiny_model: Callable[[str], Path]) -> None:
    """The draft's weight format is in its layout id, so a prefill pool whose draft
    makes bf16 prompt KV and a decode pool drafting in int4 disagree at the handshake
    (``KVLayout.check_compatible``); ``speculative_config.quantization`` makes them
    agree whatever each pool's own quantization."""
    path = tiny_model("llama-gqa")
    plain = engine(path, spec=draft(path), role="prefill")
    inherited = engine(path, spec=draft(path), role="decode", quantization="int4")
    assert inherited.draft_model_id == f"{plain.draft_model_id} (int4)"
    for quant in ("none", "int4"):
        p = engine(path, spec=draft(path, quantization=quant), role="prefill")
        d = engine(path, spec=draft(path, quantization=quant), role="decode",
                   quantization="int4")
        assert p.draft_model_id == d.draft_model_id


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_tokens": 30, "ignore_eos": True}


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                        "logit_bias": {5: 3.0, 9: -2.0}, "min_tokens": 20,
                                        "logprobs": 2}],
                         ids=["plain", "penalties-bias-min-tokens-logprobs"])
def test_a_sampled_draft_is_the_token_the_target_samples(tiny_model: Callable[[str], Path],
                                                          backend: str,
                                                          extra: dict[str, object]) -> None:
    """At temperature 0.8 (top-k, top-p, and with penalties, a bias, min_tokens and
    logprobs) the target as its own draft guesses the token the target then samples:
    the draft samples with the request's parameters and the very draws verification
    makes next. A greedy guess would be accepted only with its probability (well under
    90% at this temperature). Seeded, the tokens (and logprobs) are the unspeculated
    ones (the logprobs too where the kernels are batch invariant, else within float
    rounding); unseeded requests draft from a generator of their own."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=5)
    seeded = [SamplingParams(**{**SAMPLED, **extra}, seed=s) for s in (1, 2, 3)]  # type: ignore[arg-type]
    want = engine(path, backend, spec=None).generate(ps, seeded)
    for params in (seeded, SamplingParams(**{**SAMPLED, **extra})):  # type: ignore[arg-type]
        eng = engine(path, backend, spec=draft(path))
        got = eng.generate(ps, params)
        if params is seeded:
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            lps = [lp.logprob for c in got for lp in c.logprobs or []]
            ref = [lp.logprob for c in want for lp in c.logprobs or []]
            assert lps == (ref if backend == "cpu" else pytest.approx(ref, abs=1e-4))
        stats = eng.stats().spec
        assert stats is not None and stats.num_drafts > 0
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
        drained(eng)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 5},
                                      {"temperature": 0.8}], ids=["greedy", "seeded", "unseeded"])
def test_a_structured_output_drafts_under_its_grammar(tiny_model: Callable[[str], Path],
                                                      sampling: dict[str, object]) -> None:
    """The target as its own draft, a regex-constrained request: each draft token is
    sampled under the grammar's mask after the draft before it, as verification
    samples that position, so the guesses are the target's tokens (unmasked, the
    random tiny model would guess off-grammar tokens and its drafts be cut to
    nothing). Greedy and seeded, the tokens are the unspeculated ones."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=4)
    params = SamplingParams(max_tokens=40, structured=SENTENCES, **sampling)  # type: ignore[arg-type]
    want = engine(path, "cpu", spec=None).generate(ps, params)
    eng = engine(path, "cpu", spec=draft(path))
    got = eng.generate(ps, params)
    if "seed" in sampling or not sampling:
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c in got:
        assert ("the cat sat on the mat. " * 8).startswith(c.text), c.text
    stats = eng.stats().spec
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
    drained(eng)


def test_unseeded_sampling_with_a_draft_keeps_the_targets_distribution(
        tiny_model: Callable[[str], Path]) -> None:
    """Unseeded requests at temperature 0.8 with top-k: the tokens after the first
    (verified against the draft's guesses) are distributed as without speculation,
    token by token within 5 standard errors -- a private generator seeded alike for
    every request, or drawn from twice, would not be."""
    path, small = tiny_model("llama-gqa"), tiny_model("llama-mha")
    prompt = copy_prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=3, ignore_eos=True)
    n = 320
    counts = []
    for spec in (None, draft(small, 2, disable_by_batch_size=64)):
        eng = engine(path, spec=spec, max_num_seqs=64)
        torch.manual_seed(0)
        out = eng.generate([prompt] * n, params)
        counts.append([Counter(c.token_ids[j] for c in out) for j in (1, 2)])
        if spec is not None:
            stats = eng.stats().spec
            assert stats is not None and stats.num_draft_tokens >= n
            drained(eng)
    for plain, spec in zip(*counts, strict=True):
        for token in set(plain) | set(spec):
            p, q = plain[token] / n, spec[token] / n
            assert abs(p - q) <= 5 * math.sqrt(max(p * (1 - p), 1e-3) * 2 / n), (token, p, q)


def test_a_draft_model_under_tensor_parallelism(tiny_model: Callable[[str], Path]) -> None:
    """Two ranks: rank 0 alone holds the draft (whole) and tells rank 1 its drafts, so
    both verify the same ones and stay in step; greedy and seeded tokens are the
    unspeculated engine's, and a draft equal to the target is accepted."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=14)
    seeded = [SamplingParams(**SAMPLED, seed=s) for s in (4, 5)]  # type: ignore[arg-type]
    with tp_engine(path, draft(path)) as eng:
        assert eng.draft is not None
        for params in (GREEDY, seeded):
            want = run_checked(engine(path, "torch", spec=None), ps, params)
            assert run_checked(eng, ps, params) == want
        stats = eng.stats().spec
        assert stats is not None and stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
        assert measured_cost(eng) == 0  # every rank picks the same lengths: not by timings
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
    run_checked(eng, copy_prompts(3, seed=8), GREEDY)
    stats = eng.stats().spec
    assert stats is not None and stats.num_accepted_tokens < stats.num_draft_tokens
    alone = engine(small, spec=None, dtype="float32")
    checked = calls[:: max(1, len(calls) // 12)]
    assert len(checked) >= 6
    for tokens, d in checked:
        assert d and run_checked(alone, [tokens], SamplingParams(max_tokens=len(d), ignore_eos=True))[0] == d


def test_preemption_aborts_and_tight_draft_blocks(tiny_model: Callable[[str], Path]) -> None:
    """Few blocks: the target preempts, and the draft's cache (as many blocks) runs out
    too -- its least recently used mirrors are dropped and caught up again. An abort
    in mid-speculation gives the draft's blocks back."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(6, seed=7)
    want = run_checked(engine(path, spec=None), ps, GREEDY)
    eng = engine(path, spec=draft(path, disable_by_batch_size=64), num_blocks=22, block_size=8)
    assert run_checked(eng, ps, GREEDY) == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    drained(eng)
    eng.add_request("a", ps[0], GREEDY)
    while eng.draft is not None and not eng.draft.mirrors:
        eng.step()
    eng.abort("a")
    drained(eng)


def _disaggregated(path: Path, small: Path, prompt: list[int],
                   hand: bool) -> tuple[list[int], list[int], list[list[int]]]:
    """``prompt`` prefilled on one engine and decoded on another, both with the draft
    ``small`` (its prompt KV handed over too with ``hand``): the tokens, the tokens the
    decode engine's draft computed per run, and its drafts."""
    prefill = engine(path, spec=draft(small), role="prefill")
    decode = engine(path, spec=draft(small), role="decode", num_blocks=64)
    assert decode.draft is not None and prefill.draft is not None
    computed: list[int] = []
    drafts: list[list[int]] = []
    run, propose = decode.draft._run, decode.draft.propose

    def counted(work: list[tuple[Request, int]], rows: dict[str, SamplingRow]) -> dict[str, int]:
        computed.append(sum(n for _, n in work))
        return run(work, rows)

    def recorded(wanted: list[tuple[Request, int]]) -> list[list[int]]:
        out = propose(wanted)
        drafts.extend(out)
        return out

    decode.draft._run = counted  # type: ignore[method-assign]
    decode.draft.propose = recorded  # type: ignore[method-assign]
    first = disaggregate(prefill, decode, "r", prompt, GREEDY, draft=hand)
    tokens, _ = decode_to_end(decode)
    drained(decode)
    assert decode.pool.num_used == 0 and prefill.pool.num_used == 0
    prefill.check_integrity()
    return [first, *tokens], computed, drafts


@pytest.mark.parametrize("handed", [True, False], ids=["draft-kv-handed", "caught-up"])
def test_decode_worker_drafts_from_its_first_step(tiny_model: Callable[[str], Path],
                                                  handed: bool) -> None:
    """Disaggregated: the prefill engine computes the draft's prompt KV (at its target
    blocks) and it is handed over with the target's: the decode engine's draft starts
    from the whole prompt and computes only the tokens after it. Without it (no draft
    blocks reserved) the draft catches up on the prompt in its first step. Either way
    every draft is the same (the draft's own greedy continuation: a misplaced or stale
    handed-over row would change it) and the tokens are the target's."""
    path, small = tiny_model("llama-gqa"), tiny_model("llama-mha")
    prompt = copy_prompts(1, seed=11)[0]
    want = run_checked(engine(path, spec=None), [prompt], GREEDY)[0]
    tokens, computed, drafts = _disaggregated(path, small, prompt, handed)
    assert tokens == want
    # the first speculating step: the first token only, or the whole prompt too
    assert computed[0] == (1 if handed else len(prompt) + 1), computed[:3]
    other = _disaggregated(path, small, prompt, not handed)
    assert other[0] == want and other[2] == drafts and len(drafts) > 3


def test_reserved_draft_blocks_are_never_evicted(tiny_model: Callable[[str], Path],
                                                 tmp_path: Path) -> None:
    """Draft blocks a transfer writes into stay the request's until its KV landed (or
    it is gone). The draft caches no prefix, so requests sharing the target's prefix
    blocks run its pool out first: a decoding request's mirror gives way (it catches
    up later), a landing one never does; with no room left, a reservation gets none."""
    path, twin = tiny_model("llama-gqa"), tmp_path / "twin"
    shutil.copytree(path, twin)  # (the target's own directory would reserve none)
    decode = engine(path, spec=draft(twin), role="decode", num_blocks=8, block_size=8)
    assert decode.draft is not None
    prompt = copy_prompts(1, seed=3)[0][:30]  # 4 blocks, 3 of them full
    got = {}
    for rid in ("a", "b", "c", "d"):
        assert decode.reserve(rid, prompt, SamplingParams(max_tokens=2)) is not None
        got[rid] = decode.reserve_draft(rid)
        if rid == "a":
            decode.start_decode("a", 1)  # its prefix blocks are shared from here on
    assert [len(got[r]) for r in "abc"] == [4, 4, 4] and got["d"] == []
    assert set(got["c"]) == set(got["a"]) and not set(got["b"]) & set(got["c"])
    assert "a" not in decode.draft.mirrors  # decoding: its mirror gave way
    for rid in "abcd":
        decode.abort(rid)
    drained(decode)


def test_draft_model_config_is_checked(tiny_model: Callable[[str], Path],
                                       tmp_path: Path) -> None:
    path = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig(method="ngram", model=str(path))
    with pytest.raises(ValueError, match=r"quantization is the draft model's"):
        SpeculativeConfig(method="ngram", quantization="int4")
    with pytest.raises(ValueError, match=r"speculative_config\.quantization must be one of"):
        SpeculativeConfig(method="draft_model", model=str(path), quantization="int3")
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
