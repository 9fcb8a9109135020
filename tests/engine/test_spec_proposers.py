"""Speculative decoding's parts on their own (engine/spec/spec_decode.py): the n-gram,
prediction and suffix proposers, adaptive draft lengths and what a draft is worth,
the speculative config's checks, and exact verification."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pdserve.engine.config import EngineConfig, SpeculativeConfig
from pdserve.engine.sampling.sampler import Sampler, SamplingRow
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.spec.spec_decode import (
    NgramProposer,
    PredictionProposer,
    SpecState,
    SuffixCache,
    SuffixProposer,
    verify,
    worth,
)


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
