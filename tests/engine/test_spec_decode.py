"""Speculative decoding in the engine (engine/spec/spec_decode.py): the same tokens with
and without it (greedy, seeded sampling, bans, stops, preemption, hand-off, tensor
parallel, structured outputs, predictions, suffix decoding), the batch limit, and
verification computing what decoding does bit for bit (the proposers and verification
on their own: test_spec_proposers.py)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.spec.spec_decode import batch_limit
from tests.engine.engines import prompts
from tests.engine.handoff import decode_to_end, disaggregate
from tests.engine.spec_helpers import (
    GREEDY,
    NGRAM,
    SENTENCES,
    copy_prompts,
    engine,
    run_checked,
    tp_engine,
)


def test_greedy_output_is_unchanged_and_drafts_are_accepted(
        tiny_model: Callable[[str], Path], backend: str) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3)
    want = run_checked(engine(path, backend, spec=None), ps, GREEDY)
    eng = engine(path, backend)
    assert run_checked(eng, ps, GREEDY) == want
    stats = eng.stats().spec
    assert stats is not None and stats.num_drafts > 0
    # Both outcomes happened: accepted tokens and rejected ones.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_seeded_sampling_is_unchanged_token_for_token(tiny_model: Callable[[str], Path],
                                                      backend: str) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=3)
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, top_k=20, seed=s,
                             repetition_penalty=1.1, frequency_penalty=0.2, logprobs=2,
                             ignore_eos=True) for s in (1, 2, 3)]
    base = engine(path, backend, spec=None).generate(ps, params)
    eng = engine(path, backend)
    got = eng.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in base]
    for a, b in zip(got, base, strict=True):  # logprobs of every token, same values
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        assert [lp.logprob for lp in a.logprobs] == pytest.approx(
            [lp.logprob for lp in b.logprobs], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in a.logprobs] == \
            [[t for t, _ in lp.top] for lp in b.logprobs]
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_bans_hold_at_every_drafted_position(tiny_model: Callable[[str], Path]) -> None:
    """bad_words look at the draft's tokens before each verified position: the output
    is the unspeculated one, drafts are still accepted, and no banned pair is written."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=5)
    free = run_checked(engine(path, spec=None), ps, GREEDY)
    pairs = [(o[10], o[11]) for o in free]
    params = dataclasses.replace(GREEDY, bad_words=pairs)
    want = run_checked(engine(path, spec=None), ps, params)
    eng = engine(path)
    got = run_checked(eng, ps, params)
    assert got == want and got != free
    assert not {(a, b) for o in got for a, b in itertools.pairwise(o)} & set(pairs)
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_stops_inside_a_draft_end_where_they_would_without_one(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=5)
    free = run_checked(engine(path, spec=None), ps, GREEDY)
    # each stop token is one of its output's later tokens: it ends a verified run
    stops = [out[len(out) * 2 // 3] for out in free]
    for params in ([SamplingParams(max_tokens=40, stop_token_ids=[s], ignore_eos=True)
                    for s in stops],
                   [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 10)]):
        want = run_checked(engine(path, spec=None), ps, params)
        eng = engine(path)
        assert run_checked(eng, ps, params) == want
        assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert [w[-1] for w in run_checked(engine(path), ps, [SamplingParams(
        max_tokens=40, stop_token_ids=[s], ignore_eos=True) for s in stops])] == stops


def test_preemption_and_tight_blocks_keep_output_and_free_everything(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(6, seed=7)
    want = run_checked(engine(path, spec=None), ps, GREEDY)
    spec = {**NGRAM, "disable_by_batch_size": 64}
    tight = engine(path, spec=spec, num_blocks=22, block_size=8)
    assert run_checked(tight, ps, GREEDY) == want
    assert tight.scheduler.num_preemptions > 0
    assert tight.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_no_speculation_over_the_batch_limit(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=2)
    eng = engine(path, spec={**NGRAM, "disable_by_batch_size": 2})
    run_checked(eng, ps, SamplingParams(max_tokens=6, ignore_eos=True))  # 3 running > 2
    assert eng.stats().spec.num_drafts == 0  # type: ignore[union-attr]
    run_checked(eng, ps[:1], GREEDY)
    assert eng.stats().spec.num_drafts > 0  # type: ignore[union-attr]


def test_an_unset_batch_limit_is_the_kernel_familys(tiny_model: Callable[[str], Path]) -> None:
    """Without ``disable_by_batch_size`` the engine's linear family sets the limit:
    8 on AMX's tile unit (bf16), where drafting still pays at 8 running requests, 4
    for the other families and for quantized weights, 2 for a draft model on any
    family; a set limit wins. Each bf16
    family this CPU runs: 6 running requests draft exactly where the limit is 8."""
    from pdserve.engine import kernels
    from pdserve.engine.model.linear import cpu_families

    assert batch_limit(SpeculativeConfig(), "cpu-amx", "none") == 8
    assert batch_limit(SpeculativeConfig(), "cpu-avx512bf16", "none") == 4
    assert batch_limit(SpeculativeConfig(), "torch", "none") == 4
    assert batch_limit(SpeculativeConfig(), "cpu-amx", "int4") == 4
    assert batch_limit(SpeculativeConfig(disable_by_batch_size=2), "cpu-amx", "none") == 2
    drafted = SpeculativeConfig(method="draft_model", model="d")  # its own steps cost
    assert batch_limit(drafted, "cpu-amx", "none") == 2
    assert batch_limit(dataclasses.replace(drafted, disable_by_batch_size=6), "cpu-amx",
                       "none") == 6
    if kernels.cpu_supported() is not None:
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    path = tiny_model("llama-gqa")
    ps = copy_prompts(6, seed=2)
    for family in cpu_families(torch.bfloat16):
        eng = engine(path, linear_backend=f"cpu-{family}", dtype="bfloat16")
        assert eng.spec_batch_limit == (8 if family == "amx" else 4), family
        run_checked(eng, ps, SamplingParams(max_tokens=12, ignore_eos=True))  # 6 running
        drafts = eng.stats().spec.num_drafts  # type: ignore[union-attr]
        assert (drafts > 0) == (family == "amx"), (family, drafts)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_structured_outputs_speculate_within_their_grammar(
        tiny_model: Callable[[str], Path], backend: str, sampling: dict[str, object]) -> None:
    """A structured-output request speculates: its drafts are cut to what its grammar
    allows, and each verified position is sampled under the grammar's mask after the
    draft's tokens before it. The text repeats a sentence, so the n-gram proposer
    drafts it and the drafts are accepted; the tokens are the unspeculated ones, and
    the text is the grammar's."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=4)
    params = SamplingParams(max_tokens=60, structured=SENTENCES, **sampling)  # type: ignore[arg-type]
    want = engine(path, backend, spec=None).generate(ps, params)
    eng = engine(path, backend)
    got = eng.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c in got:  # the grammar's text, or the start of it where max_tokens cut it
        assert (re.fullmatch(r"(the cat sat on the mat\. ){3,8}", c.text) if c.finish_reason == "stop"
                else ("the cat sat on the mat. " * 8).startswith(c.text)), (c.finish_reason, c.text)
    stats = eng.stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0, stats
    eng.check_integrity()
    assert eng.pool.num_used == 0 and not eng.requests


def test_structured_outputs_speculate_under_tensor_parallelism(
        tiny_model: Callable[[str], Path]) -> None:
    """Two ranks: the grammar is rank 0's, which tells rank 1 where each draft is cut,
    so both verify the same rows and stay in step."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=4)
    params = SamplingParams(max_tokens=40, structured=SENTENCES)
    want = run_checked(engine(path, "torch", spec=None), ps, params)
    with tp_engine(path, NGRAM) as eng:
        assert run_checked(eng, ps, params) == want
        assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_a_draft_the_grammar_rejects_is_cut(tiny_model: Callable[[str], Path]) -> None:
    """Drafts are cut at the first token the grammar does not allow: a proposer that
    always guesses off-grammar tokens gets nothing verified for a structured request
    (and the request's tokens are unchanged)."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(1, seed=4)
    params = SamplingParams(max_tokens=30, structured=SENTENCES)
    want = run_checked(engine(path, spec=None), ps, params)
    eng = engine(path)
    eng.add_request("g", ps[0], params)
    req = eng.requests["g"]
    assert req.spec is not None
    off = eng.tokenizer.encode("0123")  # type: ignore[union-attr]
    req.spec.proposer.propose = lambda tokens, k: off[:k]  # type: ignore[union-attr, method-assign]
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step().outputs:
            tokens.extend(out.new_token_ids)
    assert tokens == want[0]
    assert eng.stats().spec.num_drafts == 0  # type: ignore[union-attr]


def test_decode_worker_speculates_from_its_first_step(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    prompt = copy_prompts(1, seed=11)[0]
    want = run_checked(engine(path, spec=None), [prompt], GREEDY)[0]
    prefill = engine(path, role="prefill")
    assert prefill.spec_config is None
    decode = engine(path, role="decode", num_blocks=64)
    first = disaggregate(prefill, decode, "r", prompt, GREEDY)
    tokens, steps = decode_to_end(decode)
    assert [first, *tokens] == want
    assert steps < len(want) - 1  # some steps gave more than one token
    decode.check_integrity()
    assert decode.pool.num_used == 0


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_a_prediction_is_drafted_and_changes_no_token(tiny_model: Callable[[str], Path],
                                                      spec: dict[str, object] | None) -> None:
    path = tiny_model("llama-gqa")
    ps = prompts(3, [11, 17, 9], 500, seed=21)  # nothing to copy from the prompt
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    want = run_checked(engine(path, spec=None), ps, greedy)
    seeded = [SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    sampled = run_checked(engine(path, spec=None), ps, seeded)
    # the true output with one token changed, the true output, and noise
    edited = [w[:10] + [(w[10] + 1) % 500] + w[11:] for w in want]
    for predictions, accepted in ((edited, 40), (want, 60), ([list(range(30))] * 3, 0)):
        eng = engine(path, spec=spec)
        params = [dataclasses.replace(greedy, prediction=p) for p in predictions]
        assert run_checked(eng, ps, params) == want
        stats = eng.stats().spec  # None: nothing drafted (noise matches nothing)
        assert (0 if stats is None else stats.num_accepted_tokens) >= accepted
        eng = engine(path, spec=spec)
        params = [dataclasses.replace(s, prediction=p) for s, p in zip(seeded, predictions,
                                                                     strict=True)]
        assert run_checked(eng, ps, params) == sampled


def test_a_retried_request_finds_its_place_in_the_prediction(
        tiny_model: Callable[[str], Path]) -> None:
    """A retry's prompt ends with the output already sent (``resumed_tokens``): the
    proposer walks those tokens and drafts what follows them in the prediction."""
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [11], 500, seed=21)[0]
    want = run_checked(engine(path, spec=None), [prompt], SamplingParams(max_tokens=30,
                                                                 ignore_eos=True))[0]
    eng = engine(path, spec=None)
    params = SamplingParams(max_tokens=23, resumed_tokens=7, ignore_eos=True,
                            prediction=want)
    assert run_checked(eng, [prompt + want[:7]], params)[0] == want[7:]
    stats = eng.stats().spec
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 10


def test_a_decode_worker_drafts_a_prediction_from_its_first_step(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [13], 500, seed=23)[0]
    want = run_checked(engine(path, spec=None), [prompt], GREEDY)[0]
    params = dataclasses.replace(GREEDY, prediction=want[1:])
    prefill = engine(path, spec=None, role="prefill")
    decode = engine(path, spec=None, role="decode", num_blocks=64)
    first = disaggregate(prefill, decode, "r", prompt, params)
    tokens, steps = decode_to_end(decode)
    assert [first, *tokens] == want
    assert steps <= len(want) // 4  # 8 tokens a step once the draft length has grown
    assert prefill.stats().spec is None  # a prefill engine drafts nothing
    decode.check_integrity()
    assert decode.pool.num_used == 0


def test_tensor_parallel_ranks_agree_on_drafts(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=13)
    want = run_checked(engine(path, backend="torch", spec=None), ps, GREEDY)
    with tp_engine(path, NGRAM) as eng:
        assert run_checked(eng, ps, GREEDY) == want
        assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verifying_a_draft_computes_what_decoding_does_bit_for_bit(
        tiny_model: Callable[[str], Path], dtype: str) -> None:
    """The C++ kernels: a decoding request's logits for positions p..p+4 are the same
    bits whether computed one step each or as one verification of a 4-token draft (in
    bfloat16 a last-bit difference in attention can flip an argmax tokens later)."""
    from pdserve.engine import kernels

    if kernels.cpu_supported() is not None:
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    eng = engine(tiny_model("llama-gqa"), spec=None, dtype=dtype)
    eng.add_request("a", copy_prompts(1)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()  # the prompt
    captured: list[torch.Tensor] = []
    logits = eng.model.logits
    eng.model.logits = lambda h: captured.append(logits(h)) or captured[-1]  # type: ignore[method-assign]
    for _ in range(5):
        eng.step()
    decoded = torch.cat(captured)
    req = eng.requests["a"]
    tokens = list(req.token_ids)
    start = req.num_computed_tokens - 5  # rewind, and verify the 5 as one draft
    req.num_computed_tokens = start
    del req.token_ids[start + 1:]
    req.spec_token_ids = tokens[start + 1 : start + 5]
    captured.clear()
    (verified,) = eng.runner.execute(ScheduledBatch(work=[(req, 5)]))
    assert torch.equal(captured[0], decoded)
    assert verified.token_ids == tokens[start + 1 : start + 6]


def test_suffix_decoding_drafts_a_repeated_answer_from_the_cache(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [20], 500, seed=21)[0]  # nothing in it repeats
    want = run_checked(engine(path, spec=None), [prompt], GREEDY)
    eng = engine(path, spec={"method": "suffix", "num_speculative_tokens": 8,
                             "prompt_lookup_min": 2})
    assert run_checked(eng, [prompt], GREEDY) == want
    first = eng.stats().spec.num_accepted_tokens  # type: ignore[union-attr]
    assert len(eng.suffix_cache) == 1  # type: ignore[arg-type]
    assert run_checked(eng, [prompt], GREEDY) == want  # asked again: drafted from the first answer
    again = eng.stats().spec.num_accepted_tokens - first  # type: ignore[union-attr]
    assert again >= len(want[0]) // 2 > first
