"""Speculative decoding (engine/spec/spec_decode.py): the n-gram proposer, adaptive draft
lengths, exact verification, and the engine producing the same tokens with and
without it (greedy, seeded sampling, stops, preemption, hand-off, tensor parallel)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig, SpeculativeConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampler import Sampler, SamplingRow
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.spec.spec_decode import (
    NgramProposer,
    PredictionProposer,
    SpecState,
    SuffixCache,
    SuffixProposer,
    batch_limit,
    verify,
    worth,
)
from pdserve.worker.tensor_parallel import create_engine
from tests.engine.handoff import decode_to_end, disaggregate
from tests.engine.test_engine import BACKENDS, prompts

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


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    from pdserve.engine import kernels

    if request.param == "cpu" and kernels.cpu_supported() is not None:
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    return str(request.param)


# ------------------------------------------------------------------ proposer
def test_ngram_proposes_what_followed_the_longest_most_recent_match() -> None:
    p = NgramProposer(1, 3)
    # suffix [7, 8] occurred at 1..2 (followed by 9, 4) and at 5..6 (followed by 5)
    tokens = [1, 7, 8, 9, 4, 7, 8, 5, 2, 7, 8]
    assert p.propose(tokens, 2) == [5, 2]  # the most recent occurrence of the longest match
    tokens += [3]  # suffix [8, 3] never occurred; [3] neither
    assert p.propose(tokens, 3) == []
    tokens += [9]  # [9] occurred once, followed by 4, 7, 8
    assert p.propose(tokens, 5) == [4, 7, 8, 5, 2]


def test_ngram_continuation_stops_at_the_end_and_index_is_incremental() -> None:
    p = NgramProposer(2, 2)
    tokens = [5, 6, 5, 6]
    # [5, 6] at 0..1, followed by what is left (5, 6): a repeating span, repeated
    assert p.propose(tokens, 4) == [5, 6, 5, 6]
    tokens += [5]  # suffix [6, 5] at 1..2, followed by 6, 5
    assert p.propose(tokens, 3) == [6, 5, 6]
    assert NgramProposer(2, 4).propose([1, 2], 4) == []  # too short to have a match


def test_a_prediction_drafts_from_its_start_and_finds_its_place_again() -> None:
    prompt = [90, 91, 92]
    p = PredictionProposer([1, 2, 3, 4, 5, 6, 7, 8], len(prompt), 2, 3, fallback=None)
    assert p.propose(prompt, 3) == [1, 2, 3]  # no output yet: the prediction's start
    tokens = [*prompt, 1, 2]
    assert p.propose(tokens, 3) == [3, 4, 5]  # in step: what follows
    tokens += [40, 41]  # left the prediction (a word inserted), no n-gram of it matches
    assert p.propose(tokens, 3) == []
    tokens += [4, 5]  # back in it: [4, 5] is followed by 6
    assert p.propose(tokens, 2) == [6, 7]
    tokens += [6, 7, 8]  # its end: nothing more to draft, and no fallback
    assert p.propose(tokens, 2) == []
    # with a fallback (the pool's n-grams over the request's own tokens)
    q = PredictionProposer([1, 2], 2, 2, 2, fallback=NgramProposer(2, 2))
    assert q.propose([5, 6, 1, 2, 5, 6], 2) == [1, 2]  # past the end: [5, 6] came before


def test_spec_state_adapts_the_draft_length_and_pauses_after_misses() -> None:
    s = SpecState.of(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert s.propose(tokens, 10) == [3, 1, 2, 3]
    assert s.propose(tokens, 2) == [3, 1]  # never past the room left
    s.observe(4, 1)  # one accepted: next draft is 2 long
    assert s.k == 2 and s.propose(tokens, 10) == [3, 1]
    s.observe(2, 2)  # all accepted: grows
    assert s.k == 3
    s.observe(3, 0)
    assert s.k == 1 and s.paused == 2  # nothing accepted: pause 2 steps
    assert s.propose(tokens, 10) == [] and s.propose(tokens, 10) == []
    assert s.propose(tokens, 10) == [3]
    s.observe(1, 0)
    assert s.paused == 4  # a second miss in a row pauses longer
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 10, 3)


def test_a_draft_is_as_long_as_pays_for_its_cost() -> None:
    """``worth``: a verifying step with k drafted tokens makes 1 + a + ... + a^k tokens
    for 1 + k x cost steps; the length with the most tokens per step, 0 where none
    beats a plain step."""
    assert worth(0.95, 0.0, 6) == 6  # free drafts: always the longest
    assert worth(0.95, 0.1, 6) == 6
    assert worth(0.65, 0.45, 6) == 1  # 1.65 / 1.45 beats 2.07 / 1.9
    assert worth(0.13, 0.45, 6) == 0  # 1.13 / 1.45 < 1
    assert worth(0.99, 2.0, 6) == 0  # a draft dearer than a step never pays
    assert [worth(a / 10, 0.4, 8) for a in range(11)] == sorted(
        worth(a / 10, 0.4, 8) for a in range(11))  # longer as acceptance grows


def test_a_costly_draft_follows_the_requests_acceptance() -> None:
    """With a draft token's cost (a draft model's), a request's length is also capped
    by what pays at its acceptance, a moving average over its verified positions:
    rejections bring it down until no length pays; then it pauses and probes with one
    token, and acceptance brings the length back."""
    s = SpecState.of(SpeculativeConfig(method="draft_model", model="d",
                                       num_speculative_tokens=6))
    assert s.proposer is None and s.acceptance == 0.9
    assert s.draft_length(10, 0.0) == 6 and s.draft_length(10, 0.1) == 6
    for _ in range(4):
        s.observe(2, 0)  # rejected at once: the misses pause too, as for any draft
        s.paused = 0
    assert s.acceptance < 0.4
    assert s.draft_length(10, 0.45) == 0 and s.paused == 2 and s.probe  # nothing pays
    assert s.draft_length(10, 0.45) == 0 and s.draft_length(10, 0.45) == 0
    assert s.draft_length(10, 0.45) == 1 and not s.probe  # the probe
    assert s.draft_length(10, 0.45) == 0 and s.paused == 4  # still nothing: longer
    s.paused, s.probe = 0, False
    for _ in range(6):
        s.observe(3, 3)
    assert s.acceptance > 0.9 and s.k == 6 and s.draft_length(10, 0.45) >= 4
    assert s.draft_length(2, 0.45) == 2  # never past the room left


def test_speculative_config_is_checked() -> None:
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        EngineConfig(speculative_config={"method": "ngram", "lookahead": 3})  # type: ignore[arg-type]
    cfg = EngineConfig(speculative_config={"method": "ngram"})  # type: ignore[arg-type]
    assert cfg.speculative_config == SpeculativeConfig()


# -------------------------------------------------------------- verification
def test_verify_is_exact_in_distribution() -> None:
    """Unseeded rows, temperature 0.8 with top-k and top-p: the first token verification
    emits follows the sampler's own distribution, and the draft token is accepted with
    its probability under it."""
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 2  # one request, a draft of 2: rows 0, 1, 2
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, max_tokens=10)
    row = SamplingRow(params, [1, 2, 3], 3)
    # the sampler's distribution at position 0, by drawing it
    trials = 6000
    plain = Counter(Sampler()(logits[:1].repeat(trials, 1), [row] * trials).token_ids)
    draft = [plain.most_common(1)[0][0], 4]
    first: Counter[int] = Counter()
    for _ in range(trials):
        first[verify(Sampler(), logits, [row], [draft])[0].token_ids[0]] += 1
    for token in set(plain) | set(first):
        p, q = plain[token] / trials, first[token] / trials
        # both are estimates of one probability: 5 standard errors of their difference
        assert abs(p - q) <= 5 * math.sqrt(max(p * (1 - p), 1e-4) * 2 / trials), (token, p, q)


def test_verify_keeps_the_agreeing_prefix_plus_one() -> None:
    logits = torch.full((7, 10), -10.0)
    best = [3, 5, 7, 1, 4, 2, 6]  # greedy token of each row
    logits[torch.arange(7), torch.tensor(best)] = 10.0
    rows = [SamplingRow(SamplingParams(max_tokens=9), [0], 1) for _ in range(2)]
    # request 0: draft [3, 5] all accepted -> + row 2's token; request 1: draft [1, 9, 9]
    # -> 1 accepted, then row 5's own token 2 (not 9)
    got = verify(Sampler(), logits, rows, [[3, 5], [1, 9, 9]])
    assert [v.token_ids for v in got] == [[3, 5, 7], [1, 4]]
    ref = verify(Sampler(fast=False), logits, rows, [[3, 5], [1, 9, 9]])
    assert [v.token_ids for v in ref] == [[3, 5, 7], [1, 4]]


# ------------------------------------------------------------------- engine
def _run(eng: LLMEngine, ps: list[list[int]], params: SamplingParams | list[SamplingParams],
         ) -> list[list[int]]:
    out = [c.token_ids for c in eng.generate(ps, params)]
    eng.check_integrity()
    assert eng.pool.num_used == 0 and not eng.requests
    return out


def test_greedy_output_is_unchanged_and_drafts_are_accepted(
        tiny_model: Callable[[str], Path], backend: str) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3)
    want = _run(engine(path, backend, spec=None), ps, GREEDY)
    eng = engine(path, backend)
    assert _run(eng, ps, GREEDY) == want
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
    free = _run(engine(path, spec=None), ps, GREEDY)
    pairs = [(o[10], o[11]) for o in free]
    params = dataclasses.replace(GREEDY, bad_words=pairs)
    want = _run(engine(path, spec=None), ps, params)
    eng = engine(path)
    got = _run(eng, ps, params)
    assert got == want and got != free
    assert not {(a, b) for o in got for a, b in itertools.pairwise(o)} & set(pairs)
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_stops_inside_a_draft_end_where_they_would_without_one(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(2, seed=5)
    free = _run(engine(path, spec=None), ps, GREEDY)
    # each stop token is one of its output's later tokens: it ends a verified run
    stops = [out[len(out) * 2 // 3] for out in free]
    for params in ([SamplingParams(max_tokens=40, stop_token_ids=[s], ignore_eos=True)
                    for s in stops],
                   [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 10)]):
        want = _run(engine(path, spec=None), ps, params)
        eng = engine(path)
        assert _run(eng, ps, params) == want
        assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert [w[-1] for w in _run(engine(path), ps, [SamplingParams(
        max_tokens=40, stop_token_ids=[s], ignore_eos=True) for s in stops])] == stops


def test_preemption_and_tight_blocks_keep_output_and_free_everything(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(6, seed=7)
    want = _run(engine(path, spec=None), ps, GREEDY)
    spec = {**NGRAM, "disable_by_batch_size": 64}
    tight = engine(path, spec=spec, num_blocks=22, block_size=8)
    assert _run(tight, ps, GREEDY) == want
    assert tight.scheduler.num_preemptions > 0
    assert tight.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_no_speculation_over_the_batch_limit(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    ps = copy_prompts(3, seed=2)
    eng = engine(path, spec={**NGRAM, "disable_by_batch_size": 2})
    _run(eng, ps, SamplingParams(max_tokens=6, ignore_eos=True))  # 3 running > 2
    assert eng.stats().spec.num_drafts == 0  # type: ignore[union-attr]
    _run(eng, ps[:1], GREEDY)
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
        _run(eng, ps, SamplingParams(max_tokens=12, ignore_eos=True))  # 6 running
        drafts = eng.stats().spec.num_drafts  # type: ignore[union-attr]
        assert (drafts > 0) == (family == "amx"), (family, drafts)


SENTENCES = StructuredOutput.regex(r"(the cat sat on the mat\. ){3,8}")


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
    want = _run(engine(path, "torch", spec=None), ps, params)
    with tp_engine(path, NGRAM) as eng:
        assert _run(eng, ps, params) == want
        assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_a_draft_the_grammar_rejects_is_cut(tiny_model: Callable[[str], Path]) -> None:
    """Drafts are cut at the first token the grammar does not allow: a proposer that
    always guesses off-grammar tokens gets nothing verified for a structured request
    (and the request's tokens are unchanged)."""
    path = tiny_model("llama-gqa")
    ps = copy_prompts(1, seed=4)
    params = SamplingParams(max_tokens=30, structured=SENTENCES)
    want = _run(engine(path, spec=None), ps, params)
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
    want = _run(engine(path, spec=None), [prompt], GREEDY)[0]
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
    want = _run(engine(path, spec=None), ps, greedy)
    seeded = [SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    sampled = _run(engine(path, spec=None), ps, seeded)
    # the true output with one token changed, the true output, and noise
    edited = [w[:10] + [(w[10] + 1) % 500] + w[11:] for w in want]
    for predictions, accepted in ((edited, 40), (want, 60), ([list(range(30))] * 3, 0)):
        eng = engine(path, spec=spec)
        params = [dataclasses.replace(greedy, prediction=p) for p in predictions]
        assert _run(eng, ps, params) == want
        stats = eng.stats().spec  # None: nothing drafted (noise matches nothing)
        assert (0 if stats is None else stats.num_accepted_tokens) >= accepted
        eng = engine(path, spec=spec)
        params = [dataclasses.replace(s, prediction=p) for s, p in zip(seeded, predictions,
                                                                     strict=True)]
        assert _run(eng, ps, params) == sampled


def test_a_retried_request_finds_its_place_in_the_prediction(
        tiny_model: Callable[[str], Path]) -> None:
    """A retry's prompt ends with the output already sent (``resumed_tokens``): the
    proposer walks those tokens and drafts what follows them in the prediction."""
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [11], 500, seed=21)[0]
    want = _run(engine(path, spec=None), [prompt], SamplingParams(max_tokens=30,
                                                                 ignore_eos=True))[0]
    eng = engine(path, spec=None)
    params = SamplingParams(max_tokens=23, resumed_tokens=7, ignore_eos=True,
                            prediction=want)
    assert _run(eng, [prompt + want[:7]], params)[0] == want[7:]
    stats = eng.stats().spec
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 10


def test_a_decode_worker_drafts_a_prediction_from_its_first_step(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [13], 500, seed=23)[0]
    want = _run(engine(path, spec=None), [prompt], GREEDY)[0]
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
    want = _run(engine(path, backend="torch", spec=None), ps, GREEDY)
    with tp_engine(path, NGRAM) as eng:
        assert _run(eng, ps, GREEDY) == want
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


# ------------------------------------------------------------ suffix decoding
def test_suffix_cache_matches_recent_outputs_and_forgets_the_oldest() -> None:
    cache = SuffixCache(capacity=2, min_n=2, max_n=3)
    cache.add([1, 2, 3, 4, 5])
    cache.add([9, 2, 3, 7])
    out, at, n = cache.match([0, 2, 3])  # type: ignore[misc]
    assert out[at:] == [7] and n == 2  # the most recent output with [2, 3]
    assert cache.match([5, 6]) is None
    cache.add([6, 6, 6])  # evicts [1, 2, 3, 4, 5]; [2, 3] still points at [9, 2, 3, 7]
    assert len(cache) == 2
    assert cache.match([1, 2]) is None and cache.match([3, 4]) is None
    out, at, _ = cache.match([2, 3])  # type: ignore[misc]
    assert out[at:] == [7]
    cache.add([5])  # too short to index: ignored
    assert len(cache) == 2


def test_suffix_proposer_takes_the_longer_match_and_drafts_as_far_as_it_reaches() -> None:
    cache = SuffixCache(capacity=8, min_n=2, max_n=3)
    cache.add([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    p = SuffixProposer(2, 3, depth=24, factor=1.0, cache=cache)
    # own tokens match [12, 13] twice back (length 2); the cache matches 10..13 (length 4)
    tokens = [7, 12, 13, 40, 10, 11, 12, 13]
    assert p.propose(tokens, 8) == [14, 15, 16, 17]  # 4 long: factor x the match
    assert SuffixProposer(2, 3, 24, 0.5, cache).propose(tokens, 8) == [14, 15]
    assert SuffixProposer(2, 3, 24, 1.0, SuffixCache(8, 2, 3)).propose(tokens, 8) == [40, 10]


def test_suffix_decoding_drafts_a_repeated_answer_from_the_cache(
        tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [20], 500, seed=21)[0]  # nothing in it repeats
    want = _run(engine(path, spec=None), [prompt], GREEDY)
    eng = engine(path, spec={"method": "suffix", "num_speculative_tokens": 8,
                             "prompt_lookup_min": 2})
    assert _run(eng, [prompt], GREEDY) == want
    first = eng.stats().spec.num_accepted_tokens  # type: ignore[union-attr]
    assert len(eng.suffix_cache) == 1  # type: ignore[arg-type]
    assert _run(eng, [prompt], GREEDY) == want  # asked again: drafted from the first answer
    again = eng.stats().spec.num_accepted_tokens - first  # type: ignore[union-attr]
    assert again >= len(want[0]) // 2 > first
