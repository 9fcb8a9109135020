"""Speculative decoding: a cheap proposer guesses a decoding request's next tokens,
the model scores them all in one step, and every accepted guess is a step saved.
On a CPU a decode step is memory-bound: checking 5 tokens reads the weights once,
like checking 1 (measured with the default model: 14.3 ms either way).

Proposer (draft-free, nothing to move between workers): ``ngram`` prompt lookup,
as vLLM's. The request's last ``prompt_lookup_max`` .. ``prompt_lookup_min``
tokens are looked up among its earlier tokens (prompt and output); the tokens that
followed the most recent match are the draft (a continuation that reaches the end
is a repeating span, and is repeated). An incremental index (n-gram ->
where its continuation starts) makes a lookup O(1) per step.

Suffix decoding (``suffix``, after Arctic's and vLLM's method of that name): the
longest match of the request's last tokens in its own tokens *or* in the worker's
recent outputs (``SuffixCache``: requests that repeat what earlier ones answered),
measured backwards up to ``suffix_decoding_max_tree_depth`` tokens; the draft is
``suffix_decoding_max_spec_factor`` x that long (at most ``num_speculative_tokens``),
so a long match drafts far and a short one little.

Verification is exact: the output is the one the model would have produced
without speculation, token for token, for greedy *and* seeded random sampling.
Position ``j`` of a request's verified rows is sampled by the ordinary sampler
(penalties, bias, min_tokens, temperature, top-k/p, one uniform from the request's
generator) with the draft's first ``j`` tokens as context; the draft is accepted
while the sampled token equals it, and the first token that differs is kept as the
correction (or, with every draft token accepted, the last row gives one more).
A point-mass draft accepted with probability p(d) and a rejection resampled from p
with d removed is exactly this (the standard rejection-sampling rule for a
deterministic proposer), and sampling position by position draws one uniform per
emitted token, as the plain sampler does: a seeded stream is the same with and
without speculation, colocated, disaggregated or retried (``skip_draws``).

Draft model (``draft_model``, ``draft_model.py``): a smaller model of the same
tokenizer drafts, every speculating request batched, sampling as the target will
(the request's parameters, the draws verification makes next), so a close draft's
guess is the token verification samples.

Adaptive: a request's draft length follows its acceptance (a fully accepted draft
grows it by one, a partial one shrinks it to what was accepted + 1, and a draft
with nothing accepted pauses the request's speculation for 2, 4, .. 32 steps), and
an engine with more running requests than ``disable_by_batch_size`` does not
speculate at all (its batch is compute-bound: verification would cost more than it
saves). A structured-output request's draft is cut where its grammar stops allowing
it, and each verified position is sampled under the grammar's mask after the draft's
tokens before it (the runner computes those masks).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.sampler import Sampler, SamplingRow, is_plain_greedy

MAX_PAUSE_STEPS = 32  # longest pause of a request whose drafts were all rejected
# A draft model's per-request acceptance estimate: where it starts, and the weight of
# each new verified position in its moving average.
ACCEPTANCE_PRIOR = 0.9
ACCEPTANCE_WEIGHT = 0.2
# A pool without a speculative config drafts from a request's prediction with these.
PREDICTION_DEFAULTS = SpeculativeConfig(num_speculative_tokens=8)
# No drafts in a step with more running requests than this, where
# ``disable_by_batch_size`` is unset: where drafting stops paying under sustained load,
# measured per kernel family (``benchmarks.spec --parts 1``; docs/speculative-decoding.md,
# "Under sustained load"). On AMX's tile unit it pays up to 8; the other families
# keep 4 until measured on their own classes.
BATCH_LIMIT = 4
BATCH_LIMITS = {"cpu-amx": 8}  # linear backend -> limit, bf16 / fp32 weights
# A draft model's own steps cost at every batch size (one forward per draft token),
# where an n-gram draft is free: the default model's int4 copy drafting for it paid
# 1.3x at 2 running requests and lost at 3-4 (k = 6; ``benchmarks.spec --parts 1``).
DRAFT_MODEL_BATCH_LIMIT = 2


def batch_limit(config: SpeculativeConfig, linear_backend: str, quantization: str) -> int:
    """The running requests above which an engine drafts nothing: ``config``'s, else
    a draft model's (``DRAFT_MODEL_BATCH_LIMIT``), else its kernel family's
    (``BATCH_LIMITS``; quantized weights: ``BATCH_LIMIT``)."""
    if config.disable_by_batch_size is not None:
        return config.disable_by_batch_size
    if config.method == "draft_model":
        return DRAFT_MODEL_BATCH_LIMIT
    if quantization != "none":
        return BATCH_LIMIT
    return BATCH_LIMITS.get(linear_backend, BATCH_LIMIT)


class NgramProposer:
    """Prompt lookup over one request's tokens (they only ever grow)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n-gram -> index of the token that followed its most recent occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # continuations at positions < this are in the index

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(where the continuation starts, n) of the longest n-gram ending ``tokens``
        that occurred earlier in them (the most recent occurrence), or None."""
        end = len(tokens)
        lo, hi, index = self.min_n, self.max_n, self._next
        for e in range(max(self._indexed, lo), end):
            for n in range(lo, min(hi, e) + 1):
                index[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        for n in range(min(hi, end - 1), lo - 1, -1):
            at = index.get(tuple(tokens[end - n :]))
            if at is not None:
                return at, n
        return None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent match of the suffix."""
        found = self.match(tokens)
        return [] if found is None else _continuation(tokens, found[0], k, repeat=True)


def _continuation(source: Sequence[int], at: int, k: int, repeat: bool) -> list[int]:
    """``k`` tokens of ``source`` from ``at``; with ``repeat``, a span that reaches the
    end of the request's own tokens is a repeating one, and is repeated."""
    span = list(source[at : at + k])
    return (span * -(-k // len(span)))[:k] if repeat and span else span


def _match_length(source: Sequence[int], at: int, tokens: Sequence[int], n: int,
                  depth: int) -> int:
    """How many tokens before ``source[at]`` equal the last ones of ``tokens`` (at least
    the ``n`` of the n-gram match, at most ``depth``)."""
    end = len(tokens)
    while n < depth and at - n - 1 >= 0 and n + 1 <= end and \
            source[at - n - 1] == tokens[end - n - 1]:
        n += 1
    return n


class SuffixCache:
    """A worker's recent outputs, the shared half of suffix decoding: requests that
    repeat what earlier ones answered (agents calling the same tools, templated JSON)
    get drafts from them. At most ``capacity`` outputs (the oldest go first), indexed
    by n-gram like a request's own tokens."""

    def __init__(self, capacity: int, min_n: int, max_n: int) -> None:
        self.capacity, self.min_n, self.max_n = capacity, min_n, max_n
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()
        self._next: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output, at)
        self._ids = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def _ngrams(self, tokens: list[int]) -> list[tuple[tuple[int, ...], int]]:
        return [(tuple(tokens[e - n : e]), e) for e in range(self.min_n, len(tokens))
                for n in range(self.min_n, min(self.max_n, e) + 1)]

    def add(self, output: Sequence[int]) -> None:
        tokens = list(output)
        if len(tokens) <= self.min_n:
            return
        oid, self._ids = self._ids, self._ids + 1
        self._outputs[oid] = tokens
        for key, e in self._ngrams(tokens):
            self._next[key] = (oid, e)
        while len(self._outputs) > self.capacity:
            old, old_tokens = self._outputs.popitem(last=False)
            for key, _ in self._ngrams(old_tokens):
                if self._next.get(key, (None,))[0] == old:
                    del self._next[key]

    def match(self, tokens: Sequence[int]) -> tuple[list[int], int, int] | None:
        """(output, where its continuation starts, n) of the longest n-gram ending
        ``tokens`` found in a cached output, or None."""
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            hit = self._next.get(tuple(tokens[end - n :]))
            if hit is not None:
                return self._outputs[hit[0]], hit[1], n
        return None


class SuffixProposer:
    """Suffix decoding (Arctic's, as vLLM's ``suffix`` method): the longest match of
    the request's last tokens in its own prompt and output or in the worker's recent
    outputs (``SuffixCache``), measured up to ``depth`` tokens; the draft is as long
    as ``factor`` x that match (so a long, confident match drafts far, a two-token one
    little), at most ``k``."""

    def __init__(self, min_n: int, max_n: int, depth: int, factor: float,
                 cache: SuffixCache) -> None:
        self.own = NgramProposer(min_n, max_n)
        self.cache, self.depth, self.factor = cache, depth, factor

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        best: tuple[int, Sequence[int], int, bool] | None = None  # (length, source, at, own)
        own = self.own.match(tokens)
        if own is not None:
            best = (_match_length(tokens, own[0], tokens, own[1], self.depth), tokens, own[0],
                    True)
        shared = self.cache.match(tokens)
        if shared is not None:
            length = _match_length(shared[0], shared[1], tokens, shared[2], self.depth)
            if best is None or length > best[0]:  # the request's own wins a tie
                best = (length, shared[0], shared[1], False)
        if best is None:
            return []
        length, source, at, repeat = best
        return _continuation(source, at, min(k, max(1, int(self.factor * length))), repeat)


class PredictionProposer:
    """Drafts from the client's predicted output (OpenAI's ``prediction``): the output
    is expected to follow the prediction, so the draft is the prediction's next tokens
    from where the output stands in it (from its first token on: no n-gram needed to
    start). Where the output leaves it, its last tokens are looked up in the
    prediction (the longest n-gram, ``max_n`` .. ``min_n``; the first occurrence past
    the last place the two were in step, else the first) and it is followed from
    there; with no match, ``fallback`` (the pool's own proposer, if any) drafts."""

    def __init__(self, prediction: Sequence[int], start: int, min_n: int, max_n: int,
                 fallback: NgramProposer | SuffixProposer | None) -> None:
        self.prediction = list(prediction)
        self.min_n, self.max_n = min_n, max_n
        self.fallback = fallback
        self._seen = start  # the request's tokens taken in (the output starts here)
        self._at: int | None = 0  # the prediction's token the output should match next
        self._last = 0  # where the output was last in step with the prediction
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> continuations
        for n in range(min_n, max_n + 1):
            for e in range(n, len(self.prediction)):
                self._starts.setdefault(tuple(self.prediction[e - n : e]), []).append(e)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        pred = self.prediction
        for t in tokens[self._seen :]:
            if self._at is not None and self._at < len(pred) and pred[self._at] == t:
                self._at += 1
                self._last = self._at
            else:
                self._at = None
        self._seen = len(tokens)
        if self._at is None or self._at >= len(pred):
            self._at = self._realign(tokens)
        if self._at is not None:
            return pred[self._at : self._at + k]
        return [] if self.fallback is None else self.fallback.propose(tokens, k)

    def _realign(self, tokens: Sequence[int]) -> int | None:
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            starts = self._starts.get(tuple(tokens[end - n :]))
            if starts:
                return next((at for at in starts if at > self._last), starts[0])
        return None


def _proposer(config: SpeculativeConfig, cache: SuffixCache | None,
              ) -> NgramProposer | SuffixProposer | None:
    """A new request's proposer for ``config`` (None: the engine's draft model)."""
    lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
    if config.method == "suffix":
        assert cache is not None
        return SuffixProposer(lo, hi, config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_spec_factor, cache)
    return None if config.method == "draft_model" else NgramProposer(lo, hi)


def moving_average(average: float, sample: float, weight: float = 0.1) -> float:
    """An exponential moving average (the first sample where there is none yet)."""
    return sample if not average else average + weight * (sample - average)


def worth(acceptance: float, cost: float, limit: int) -> int:
    """The draft length in [0, limit] that makes the most tokens per unit of time: a
    verifying step with ``k`` drafted tokens makes 1 + a + ... + a^k tokens (each
    accepted with chance ``acceptance``, the first rejection ends it) and costs
    1 + k x ``cost`` steps; 0 where no length beats a plain step."""
    best, best_rate, tokens, p = 0, 1.0, 1.0, 1.0
    for k in range(1, limit + 1):
        p *= acceptance
        tokens += p
        rate = tokens / (1 + k * cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class SpecState:
    """One request's proposer and adaptive draft length (see the module doc)."""

    proposer: NgramProposer | SuffixProposer | PredictionProposer | None  # None: the draft model
    max_k: int
    k: int = 0
    misses: int = 0  # drafts in a row with nothing accepted
    paused: int = 0  # steps left without speculation
    num_drafts: int = 0  # verified drafts (steps that speculated)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # A draft model's: the chance a draft token is accepted (moving average over the
    # verified positions), and whether the next draft is a one-token probe after a
    # pause for cost (``draft_length``)
    acceptance: float = ACCEPTANCE_PRIOR
    probe: bool = False
    idle: int = 0  # pauses for cost in a row

    @classmethod
    def of(cls, config: SpeculativeConfig, cache: SuffixCache | None = None) -> SpecState:
        """A new request's state (``suffix``: drafts from ``cache`` too)."""
        n = config.num_speculative_tokens
        return cls(_proposer(config, cache), n, n)

    @classmethod
    def predicted(cls, prediction: Sequence[int], start: int, config: SpeculativeConfig | None,
                  cache: SuffixCache | None = None) -> SpecState:
        """A request's state that drafts from its ``prediction`` (its output from token
        ``start`` of its tokens), then as the pool's ``config`` does (ngram or suffix;
        None: a pool that does not speculate otherwise: ``PREDICTION_DEFAULTS``)."""
        spec = config or PREDICTION_DEFAULTS
        fallback = None if config is None else _proposer(config, cache)
        n = spec.num_speculative_tokens
        return cls(PredictionProposer(prediction, start, spec.prompt_lookup_min,
                                      spec.prompt_lookup_max, fallback), n, n)

    def draft_length(self, limit: int, cost: float = 0.0) -> int:
        """How many tokens to draft this step: at most ``limit``, none while paused.
        ``cost``: a draft token's cost in verifying steps (a draft model's, measured;
        0: free, as an n-gram's): the length is then also the one that makes the most
        tokens per unit of time at this request's acceptance (``worth``). Where no
        length pays, the request pauses (2, 4, ... 32 steps) and then drafts one token,
        to measure its acceptance again."""
        if self.paused:
            self.paused -= 1
            return 0
        k = max(0, min(self.k, limit))
        if cost <= 0 or k == 0:
            return k
        if self.probe:
            self.probe = False
            return 1
        k = worth(self.acceptance, cost, k)
        if k:
            self.idle = 0
        else:
            self.idle += 1
            self.paused = min(2 ** self.idle, MAX_PAUSE_STEPS)
            self.probe = True
        return k

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """A draft of at most ``limit`` tokens (none while paused)."""
        assert self.proposer is not None
        k = self.draft_length(limit)
        return self.proposer.propose(tokens, k) if k > 0 else []

    def observe(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        # verified positions: each accepted token, then the rejected one (if any)
        for hit in [1.0] * accepted + [0.0] * (accepted < proposed):
            self.acceptance += ACCEPTANCE_WEIGHT * (hit - self.acceptance)
        if accepted == proposed:
            self.k = min(self.max_k, self.k + 1)
        else:
            self.k = accepted + 1
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.paused = min(2 ** self.misses, MAX_PAUSE_STEPS)


@dataclass
class SpecStats:
    """An engine's speculation counters since it started (vLLM's ``spec_decode_*``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[j]: drafts whose token j was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def snapshot(self) -> SpecStats:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))


@dataclass
class Verified:
    """What verification kept of one request's rows: accepted drafts + one token."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token where the request asked, else []


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow],
           drafts: Sequence[Sequence[int]],
           allowed: Sequence[torch.Tensor | None] | None = None) -> list[Verified]:
    """Sample every request's rows in order and keep the longest agreeing prefix.

    ``logits`` holds ``1 + len(drafts[i])`` consecutive rows per request ``i``: row
    ``j`` predicts the token after its draft's first ``j`` tokens. ``rows[i]`` is
    request ``i``'s sampling row for position 0; ``allowed[i]`` (a structured-output
    request's) holds its grammar's mask for each of the ``1 + len(drafts[i])``
    positions."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + 1 + len(d))
    out = [Verified([], []) for _ in rows]
    if sampler.fast and all(is_plain_greedy(r) for r in rows):
        best = logits.argmax(dim=-1).tolist()  # every position at once
        for i, d in enumerate(drafts):
            for j in range(len(d) + 1):
                t = best[starts[i] + j]
                out[i].token_ids.append(t)
                if j == len(d) or t != d[j]:
                    break
        return out
    alive = list(range(len(rows)))
    j = 0
    while alive:
        masks = [None if allowed is None else allowed[i] for i in alive]
        at = [dataclasses.replace(rows[i], token_ids=[*rows[i].token_ids, *drafts[i][:j]],
                                  allowed=None if mask is None else mask[j])
              if j else rows[i] for i, mask in zip(alive, masks, strict=True)]
        sampled = sampler(logits[[starts[i] + j for i in alive]], at)
        still = []
        for i, t, lp in zip(alive, sampled.token_ids, sampled.logprobs, strict=True):
            out[i].token_ids.append(t)
            if lp is not None:
                out[i].logprobs.append(lp)
            if j < len(drafts[i]) and t == drafts[i][j]:
                still.append(i)
        alive = still
        j += 1
    return out
