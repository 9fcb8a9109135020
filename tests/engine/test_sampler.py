"""Sampler: greedy, filters, penalties vs a per-row reference, token bans, seeding,
statistics, logprobs."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import pdserve.engine.sampling.sampler as sampler_mod
from pdserve.engine import kernels
from pdserve.engine.sampling.sampler import (
    Sampler,
    SamplingRow,
    _apply_penalties,
    _mask_banned,
    _top_k_top_p,
    bad_word_ends,
    make_generator,
)
from pdserve.engine.sampling.sampling_params import SamplingParams

EOS = 3


def row(p: SamplingParams, prompt: Sequence[int] = (), output: Sequence[int] = ()) -> SamplingRow:
    return SamplingRow(p, [*prompt, *output], len(prompt), make_generator(p), frozenset({EOS}))


# ---------------------------------------------------------------- references


def ref_penalised(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """Per-row, per-token loops: penalties, then min_tokens masking."""
    out = logits.clone()
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        x = float(out[t])
        out[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(r.output_token_ids) < p.min_tokens:
        for t in (*r.eos_token_ids, *p.stop_token_ids):
            out[t] = -math.inf
    return out


def ref_probs(logits: torch.Tensor, p: SamplingParams) -> list[float]:
    """Temperature, top-k, top-p, min-p by sorting a Python list; float64 result."""
    scaled = [float(x) / p.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if p.top_k > 0:
        order = order[: p.top_k]
    z = sum(math.exp(scaled[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if p.top_p < 1.0 and mass >= p.top_p:
            break
        kept.append(i)
        mass += math.exp(scaled[i]) / z
    best = max(scaled[i] for i in kept)
    kept = [i for i in kept if math.exp(scaled[i] - best) >= p.min_p]
    z = sum(math.exp(scaled[i]) for i in kept)
    probs = [0.0] * len(scaled)
    for i in kept:
        probs[i] = math.exp(scaled[i]) / z
    return probs


# ---------------------------------------------------------------- greedy and filters


@pytest.mark.parametrize("fast", [True, False])
def test_greedy_is_argmax(fast: bool) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    out = Sampler(fast)(logits, [row(SamplingParams()) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
        SamplingParams(temperature=1e-9),
    ],
    ids=["top_k=1", "top_p=tiny", "min_p=1", "tiny-temperature"],
)
def test_degenerate_filters_equal_greedy(fast: bool, params: SamplingParams) -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
    out = Sampler(fast)(logits, [row(params) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("fast", [True, False])
def test_filters_keep_exactly_the_reference_support(fast: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    # Flat rows (nucleus wider than the fast candidates) and peaked rows.
    logits = torch.cat(
        [torch.randn(6, 1000, generator=gen), 6 * torch.randn(6, 1000, generator=gen)]
    )
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in [(1.0, 0, 0.9), (0.7, 50, 1.0), (1.3, 400, 0.5), (1.0, 0, 0.99),
                        (1.0, 2, 0.3), (0.5, 0, 1.0)] * 2
    ]  # fmt: skip
    work = logits.clone()
    for i, p in enumerate(params):
        work[i] /= p.temperature
    _top_k_top_p(work, params, fast)
    for i, p in enumerate(params):
        got = set(torch.isfinite(work[i]).nonzero().squeeze(1).tolist())
        want = {t for t, q in enumerate(ref_probs(logits[i], p)) if q > 0}
        assert got == want, (i, p)


@pytest.mark.parametrize("mix", ["mixed", "all-random"])
def test_fast_and_reference_paths_agree_on_mixed_batches(mix: str) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 600, generator=gen) * torch.linspace(0.5, 8, 10)[:, None]
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1),
        SamplingParams(temperature=0.9, top_k=20, seed=2, logprobs=3),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=1.2, min_p=0.1, top_p=0.95, seed=4, presence_penalty=1.0),
    ] * 2
    if mix == "all-random":
        params = [p for p in params if not p.greedy] + [
            SamplingParams(temperature=0.7, seed=s) for s in range(4)]
    outs = []
    for fast in (True, False):
        rows = [row(p, [1, 2, 3], [4, 5, 5]) for p in params]
        outs.append([Sampler(fast)(logits, rows) for _ in range(3)])
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- penalties and min_tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(frequency_penalty=0.8),
        SamplingParams(frequency_penalty=-1.5),
        SamplingParams(presence_penalty=1.1),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=-0.4),
    ],
)
def test_each_penalty_matches_the_reference(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=gen) * 3
    rows = [
        row(params, [1, 2, 2, 7], [7, 9, 9, 9, 49]),
        row(SamplingParams(), [1, 2], [3, 4]),  # untouched neighbour
        row(params, [], []),  # nothing to penalise
        row(params, [10] * 5, [11, 12, 11, 60, -1]),  # out-of-vocab ids are ignored
    ]
    work = logits.clone()
    _apply_penalties(work, rows)
    rows[3] = row(params, [10] * 5, [11, 12, 11])  # the reference sees in-vocab ids only
    for i, r in enumerate(rows):
        torch.testing.assert_close(work[i], ref_penalised(logits[i], r), rtol=1e-6, atol=1e-6)
    changed = (work[0] != logits[0]).nonzero().squeeze(1).tolist()
    expected = {1, 2, 7, 9, 49} if params.repetition_penalty != 1.0 else {7, 9, 49}
    assert set(changed) == expected


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    assert Sampler()(logits, [row(SamplingParams(), [], [1])]).token_ids == [1]
    assert Sampler()(logits, [row(SamplingParams(presence_penalty=0.5), [], [1])]).token_ids == [2]
    assert Sampler()(logits, [row(SamplingParams(repetition_penalty=1.1), [1])]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 0.5]]).repeat(400, 1)
    stop = (4,)
    greedy = SamplingParams(min_tokens=2, stop_token_ids=stop)
    random_p = SamplingParams(min_tokens=2, stop_token_ids=stop, temperature=2.0)
    masked = Sampler()(logits, [row(greedy, [], [0])] + [row(random_p, [], [0])] * 399)
    assert masked.token_ids[0] == 2
    assert not {EOS, 4} & set(masked.token_ids)
    ref = ref_penalised(logits[0], row(greedy, [], [0]))
    assert ref[EOS] == ref[4] == -math.inf
    done = Sampler()(logits[:1], [row(greedy, [], [0, 0])])
    assert done.token_ids == [EOS]


def test_ignore_eos_does_not_mask_eos() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    assert Sampler()(logits, [row(SamplingParams(ignore_eos=True))]).token_ids == [EOS]
    masked = SamplingParams(ignore_eos=True, min_tokens=1)
    assert Sampler()(logits, [row(masked)]).token_ids == [2]


@pytest.mark.parametrize("fast", [True, False])
def test_allowed_token_ids_are_the_only_tokens_drawn(fast: bool) -> None:
    logits = torch.randn(300, 50)
    allowed = (4, 17, 33)
    p = SamplingParams(allowed_token_ids=[33, 4, 17, 4], temperature=1.5)
    assert p.allowed_token_ids == allowed  # sorted, once each
    out = Sampler(fast)(logits, [row(p)] * 300).token_ids
    assert set(out) == set(allowed)  # each drawn, nothing else
    greedy = Sampler(fast)(logits, [row(SamplingParams(allowed_token_ids=allowed))] * 300)
    assert greedy.token_ids == [allowed[int(i)] for i in logits[:, allowed].argmax(-1)]
    # the logprobs stay the raw model's
    lp = Sampler(fast)(logits[:1], [row(SamplingParams(allowed_token_ids=allowed, logprobs=1))])
    assert lp.logprobs[0] is not None and lp.logprobs[0].top[0][0] == int(logits[0].argmax())


def test_bad_word_ends_follow_the_output() -> None:
    words = [(7,), (1, 2), (1, 2, 3), (5, 1, 9)]
    assert bad_word_ends(words, []) == [7]
    assert bad_word_ends(words, [4, 1]) == [7, 2]
    assert bad_word_ends(words, [1, 2]) == [7, 3]
    assert bad_word_ends(words, [5, 1]) == [7, 2, 9]
    assert bad_word_ends(words, [6, 2]) == [7]


@pytest.mark.parametrize("fast", [True, False])
def test_bad_words_are_never_completed(fast: bool) -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2], logits[0, 3], logits[0, 7] = 5.0, 4.0, 6.0
    p = SamplingParams(bad_words=[[7], [1, 2]])
    assert Sampler(fast)(logits, [row(p, [1], [])]).token_ids == [2]  # the prompt is not looked at
    assert Sampler(fast)(logits, [row(p, [], [1])]).token_ids == [3]
    assert Sampler(fast)(logits, [row(p, [], [2])]).token_ids == [2]
    drawn = Sampler(fast)(logits.repeat(200, 1), [row(replace(p, temperature=2.0), [], [1])] * 200)
    assert not {7, 2} & set(drawn.token_ids)


def test_a_ban_that_leaves_nothing_gives_way() -> None:
    """A grammar that allows only banned tokens wins over the ban; a ban that applies
    still does, whatever else is banned."""
    logits = torch.arange(8, dtype=torch.float32)[None, :].clone()
    only_5 = torch.tensor([1 << 5], dtype=torch.int32)
    r = row(SamplingParams(allowed_token_ids=(1, 2), bad_words=[[2]]))
    r.allowed = only_5
    assert Sampler()(logits, [r]).token_ids == [5]
    both = row(SamplingParams(allowed_token_ids=(1, 2), bad_words=[[2]]))
    assert Sampler()(logits, [both]).token_ids == [1]
    eos_only = row(SamplingParams(allowed_token_ids=(EOS,), min_tokens=3))
    assert Sampler()(logits, [eos_only]).token_ids == [EOS]


# ---------------------------------------------------------------- randomness


random_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, 5, 300]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.05]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
)


@settings(max_examples=30, deadline=None)
@given(
    target=random_params.filter(lambda p: p.seed is not None and not p.greedy),
    others=st.lists(random_params, max_size=5),
    shuffle_seed=st.integers(0, 1000),
    fast=st.booleans(),
)
def test_seeded_row_is_independent_of_batch(
    target: SamplingParams, others: list[SamplingParams], shuffle_seed: int, fast: bool
) -> None:
    vocab = 400
    gen = torch.Generator().manual_seed(shuffle_seed)
    all_logits = torch.randn(len(others) + 1, vocab, generator=gen) * 2
    alone_row = row(target, [1, 2], [3])
    alone = [Sampler(fast)(all_logits[:1], [alone_row]).token_ids[0] for _ in range(3)]

    rows = [row(target, [1, 2], [3])] + [row(p, [5], [6, 7]) for p in others]
    order = list(range(len(rows)))
    random.Random(shuffle_seed).shuffle(order)
    pos = order.index(0)
    batched = [
        Sampler(fast)(all_logits[order], [rows[i] for i in order]).token_ids[pos] for _ in range(3)
    ]
    assert batched == alone


def test_unseeded_rows_are_random() -> None:
    logits = torch.zeros(64, 100)
    out = Sampler()(logits, [row(SamplingParams(temperature=1.0)) for _ in range(64)])
    assert len(set(out.token_ids)) > 20


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
    ],
)
def test_frequencies_match_reference_probabilities(params: SamplingParams) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -2.0])
    n = 20000
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        out = Sampler()(logits.repeat(n, 1), [row(params)] * n)
    counts = Counter(out.token_ids)
    for t, q in enumerate(ref_probs(logits, params)):
        assert abs(counts[t] / n - q) < 0.015, (t, counts[t] / n, q)
        if q == 0:
            assert counts[t] == 0


def test_seeded_generator_frequencies_and_reproducibility() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=1.0, seed=7)
    r1, r2 = row(params), row(params)
    draws1 = [Sampler()(logits, [r1]).token_ids[0] for _ in range(3000)]
    draws2 = [Sampler()(logits, [r2]).token_ids[0] for _ in range(50)]
    assert draws1[:50] == draws2
    counts = Counter(draws1)
    for t, q in enumerate(torch.softmax(logits[0], -1).tolist()):
        assert abs(counts[t] / 3000 - q) < 0.04


# ---------------------------------------------------------------- logprobs and plumbing


def test_logprobs_are_raw_log_softmax_with_ordered_top_n() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 64, generator=gen)
    params = [
        SamplingParams(logprobs=3, repetition_penalty=2.0),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=20, temperature=1.0, top_k=5, seed=3),
        SamplingParams(),
    ]
    out = Sampler()(logits, [row(p, [1, 2], [2, 9]) for p in params])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[3] is None
    for i, n in [(0, 3), (1, 0), (2, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(raw[i, tok]), abs=1e-6)
        assert lp.rank == 1 + int((raw[i] > raw[i, tok]).sum())
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want = raw[i].topk(n) if n else None
        if want is not None:
            assert [t for t, _ in lp.top] == want.indices.tolist()
            assert values == pytest.approx(want.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_is_not_modified_and_other_dtypes_are_cast(dtype: torch.dtype) -> None:
    logits = torch.randn(3, 40).to(dtype)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.8),
        SamplingParams(min_tokens=4),
    ]
    Sampler()(logits, [row(p, [1], [2]) for p in params])
    assert torch.equal(logits, before)
    greedy = Sampler()(logits, [row(SamplingParams())] * 3).token_ids
    assert greedy == logits.float().argmax(-1).tolist()


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="B == len"):
        Sampler()(torch.zeros(2, 5), [row(SamplingParams())])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(5), [row(SamplingParams())])


def test_uniform_rounding_up_to_total_picks_a_token_with_mass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))
    logits = torch.tensor([[0.0, 1.0, -math.inf, -math.inf]])
    assert Sampler()(logits, [row(SamplingParams(temperature=1.0))]).token_ids == [1]


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels do not run here")
@pytest.mark.parametrize("vocab", [1, 511, 512, 513, 4099, 49152])
def test_inverse_cdf_kernel_draws_the_references_tokens(vocab: int) -> None:
    """The sampler's one-pass draw (C++) answers the cumsum + searchsorted reference's
    token for every row: flat, peaked and one-hot rows, zero-mass tokens, uniforms at 0,
    near and at 1, and uniforms that put the target exactly on a cdf value (the search
    is strict there). Rows with no mass or a NaN answer -1 (the sampler's reference
    takes those)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen) * torch.tensor(
        [0.1, 1.0, 3.0, 8.0, 30.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 1.0])[:, None]
    logits[5, torch.rand(vocab, generator=gen) < 0.9] = -math.inf  # most tokens masked
    logits[5, 0] = 0.0
    logits[6] = -math.inf
    logits[6, vocab // 2] = 0.0  # one token with all the mass
    probs = logits.softmax(dim=-1)
    u = torch.rand(12, generator=gen, dtype=torch.float64)
    u[7], u[8], u[9], u[10] = 0.0, 1.0 - 2.0**-53, 1.0, 0.999999
    cdf = probs.double().cumsum(dim=-1)
    u[11] = cdf[11, vocab // 3] / cdf[11, -1]  # target on a cdf value
    k = kernels.load()
    assert k is not None
    got = k.inverse_cdf_rows(probs, u)
    assert got.tolist() == sampler_mod._inverse_cdf(probs, u).tolist()
    empty = torch.zeros(2, vocab)
    empty[1, 0] = math.nan
    assert k.inverse_cdf_rows(empty, torch.full((2,), 0.5, dtype=torch.float64)).tolist() == [-1, -1]


def test_mask_min_tokens_ignores_out_of_vocab_ids() -> None:
    logits = torch.zeros(1, 4)
    r = SamplingRow(
        SamplingParams(min_tokens=1, stop_token_ids=(99,)), [], 0, None, frozenset({2})
    )
    _mask_banned(logits, [r])
    assert logits.tolist() == [[0.0, 0.0, -math.inf, 0.0]]


def test_all_greedy_fast_path_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """B=32, V=49152 all-greedy: no general-pipeline work -- the tensor ops the sampler
    runs are one argmax over the batch (counted, not timed)."""

    def boom(*args: object) -> None:
        raise AssertionError("general path used for an all-greedy batch")

    monkeypatch.setattr(sampler_mod, "_apply_penalties", boom)
    logits = torch.randn(32, 49152)
    rows = [row(SamplingParams(min_tokens=5), range(50), range(10)) for _ in range(32)]

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ran: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        out = Sampler()(logits, rows)
    # one argmax: torch's, or the C++ kernel's (which dispatches only its output's empty)
    assert ops.ran == (["empty.memory_format"] if kernels.available() else ["argmax.default"]), ops.ran
    assert out.token_ids == logits.argmax(-1).tolist()
