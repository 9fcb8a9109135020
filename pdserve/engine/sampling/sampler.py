"""Batched token sampling: one [B, V] logits tensor in, one token per row out.

This module owns the logits-processing pipeline and the random draw. Per row,
in this order:

1. logit_bias: each listed token's bias is added to its logit,
2. penalties (repetition over prompt + output; frequency/presence over output),
3. grammar: tokens a structured-output row's matcher does not allow get -inf (the
   runner computed the row's bitmask, ``SamplingRow.allowed``),
4. bans, each applied only where it leaves the row a token to sample (where the
   grammar allows only banned tokens, the grammar wins and that ban is skipped):
   a. ``allowed_token_ids``: every other token gets -inf,
   b. ``bad_words``: the last token of each sequence whose other tokens end the
      output so far gets -inf,
   c. min_tokens: while ``len(output_token_ids) < min_tokens`` the row's EOS ids and
      ``stop_token_ids`` get -inf (``ignore_eos`` does *not* unmask EOS here: it only
      tells the engine not to stop on EOS, which is the engine's / StopChecker's job),
5. greedy rows (temperature == 0): argmax of the logits from step 2,
6. random rows: divide by temperature (clamped to >= 1e-5), then top-k, top-p
   (on the top-k survivors), min-p filtering, then one inverse-CDF draw from the
   softmax of what is left.

Logprobs, when asked for, are the *raw* model logprobs (log_softmax of the logits
as passed in, before any of the steps above), as vLLM reports by default.

Reproducibility: a row with a generator draws its one uniform per step from that
generator alone, and every tensor op is row-wise, so its tokens do not depend on
the other rows in the batch or their order. Unseeded rows share torch's global RNG.

``Sampler(fast=True)`` short-cuts the common all-greedy batch (no penalties, no
logprobs, no active min_tokens) to one vectorised argmax, and does top-k/top-p on
``torch.topk`` candidates instead of a full sort (a full sort of V=49152 costs
~5 ms per row on CPU), and draws with the C++ ``inverse_cdf_rows`` (the reference's
float64 sums in the same order, one pass a row; 32 rows of 49152: ~0.5 ms against
~5 ms for cumsum + searchsorted). ``fast=False`` is the reference path: every batch
goes through the general pipeline with full sorts and torch's cumsum. Tests check
the two agree.

Cost notes: penalties touch only the logits of tokens that occurred (sparse flat
positions, rebuilt from the token lists each step; a runner wanting more speed
could cache them per request). Logits that are not float32 are cast first. The
input tensor is never modified.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine import kernels
from pdserve.engine.sampling.grammar import apply_bitmask
from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.sampling_params import SamplingParams

# Temperatures below this are clamped so logits / temperature stays finite.
_MIN_TEMPERATURE = 1e-5
# Fast top-p first looks for the nucleus among this many best tokens.
_TOP_P_CANDIDATES = 256


@dataclass
class SamplingRow:
    """One sequence of the batch, filled by the engine runner. Holds the request's
    token list itself (no copy per step); the prompt / output slices are only made
    for the rows whose penalties need them."""

    params: SamplingParams  # the request's sampling parameters
    token_ids: Sequence[int]  # prompt + tokens generated so far
    num_prompt_tokens: int
    # Per-request RNG, from make_generator(params, device) once per request and
    # kept across steps; None when unseeded (shares the global RNG).
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] = frozenset()  # model's EOS ids (masked during min_tokens)
    # Structured output: int32 bitmask of the tokens the grammar allows next (bit t of
    # word t // 32); None when the request has no grammar.
    allowed: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:  # this attempt's (min_tokens: the router reduced it)
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> Sequence[int]:  # for the repetition penalty
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        """For the penalties and bad words: the output, an earlier attempt's included
        (``resumed_tokens``, the prompt's tail), so a retried stream is the same."""
        return self.token_ids[self.num_prompt_tokens - self.params.resumed_tokens :]


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row, in row order
    logprobs: list[TokenLogprob | None]  # per row; None where params.logprobs is None


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The per-request generator for ``params.seed`` (None when unseeded).

    Create it once per request on the logits' device and keep it across steps.
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def own_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for an unseeded random request, seeded from torch's
    global RNG: the same distribution of draws, in a stream that can be read ahead
    (a draft model samples with the draws verification makes next)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(torch.randint(2**62, (1,))))
    return gen


def skip_draws(params: SamplingParams, generator: torch.Generator | None, n: int) -> None:
    """Advance a request's generator past the draws of ``n`` tokens sampled elsewhere
    (the prefill worker's first token; an earlier attempt's output), so its stream
    continues exactly as if one engine had sampled them all."""
    if generator is not None and not params.greedy:
        for _ in range(n):  # one float64 uniform per random step, as _sample_random draws
            _draw(generator)


def _draw(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64,
                            device=generator.device)[0])


def is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.needs_processing
        and row.num_output_tokens >= p.min_tokens
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 [B, V] logits, the same answer (first index
    of the largest value, a NaN first): the C++ kernel where it runs (~0.3 ms for 32 rows
    of 49152 against torch's ~4 ms on one thread)."""
    k = kernels.load()
    if k is not None and logits.device.type == "cpu" and logits.is_contiguous():
        return k.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Stateless batched sampler; see the module docstring for the pipeline."""

    def __init__(self, fast: bool = True) -> None:
        self.fast = fast

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [B, V] with B == len(rows) == {len(rows)}, "
                f"got shape {tuple(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            logits = logits.float()
        if self.fast and all(is_plain_greedy(r) for r in rows):
            return SampleOutput(argmax(logits).tolist(), [None] * len(rows))

        processed = logits.clone(memory_format=torch.contiguous_format)
        _apply_logit_bias(processed, rows)
        _apply_penalties(processed, rows)
        constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
        if constrained:
            apply_bitmask(processed, constrained,
                          torch.stack([rows[i].allowed for i in constrained]))  # type: ignore[misc]
        _mask_banned(processed, rows)
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_idx) == len(rows):  # all random: no argmax, no copy of the rows
            tokens = _sample_random(processed, rows, self.fast)
        else:  # greedy rows keep this argmax; random rows are overwritten
            tokens = argmax(processed)
            if random_idx:
                tokens[random_idx] = _sample_random(
                    processed[random_idx], [rows[i] for i in random_idx], self.fast)
        token_ids: list[int] = tokens.tolist()
        return SampleOutput(token_ids, _logprobs(logits, token_ids, rows))


def _token_keys(
    seqs: Sequence[tuple[int, Sequence[int]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat positions ``row * V + token_id`` of (row, tokens) pairs, with counts.

    Ids outside [0, V) have no logit to penalise and are ignored.
    """
    lengths = torch.tensor([len(ids) for _, ids in seqs], dtype=torch.long)
    tokens = torch.tensor(list(itertools.chain.from_iterable(ids for _, ids in seqs)))
    tokens = tokens.to(torch.long)
    row = torch.repeat_interleave(torch.tensor([r for r, _ in seqs], dtype=torch.long), lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    keys, counts = torch.unique(row[valid] * vocab + tokens[valid], return_counts=True)
    return keys.to(device), counts.to(device)


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: add each row's ``logit_bias`` (ids outside [0, V) have no logit)."""
    vocab = logits.shape[1]
    keys = [i * vocab + t for i, r in enumerate(rows) for t, _ in r.params.logit_bias
            if 0 <= t < vocab]
    if keys:
        bias = [b for r in rows for t, b in r.params.logit_bias if 0 <= t < vocab]
        flat = logits.view(-1)
        idx = torch.tensor(keys, device=logits.device)
        flat[idx] += torch.tensor(bias, device=logits.device)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on a contiguous [B, V]: repetition (prompt + output), then frequency
    and presence (output).

    Sparse: only the logits of tokens that occurred are read and written, through
    flat positions row * V + id, so the cost scales with the token lists, not B * V.
    """
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        # A token present in prompt or output is penalised once, whatever its count.
        seqs = [(i, rows[i].prompt_token_ids) for i in rep_rows]
        seqs += [(i, rows[i].output_token_ids) for i in rep_rows]
        keys, _ = _token_keys(seqs, vocab, device)
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
        rep = rep[keys // vocab]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / rep, vals * rep)
    fp_rows = [
        i
        for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if fp_rows:
        keys, counts = _token_keys([(i, rows[i].output_token_ids) for i in fp_rows], vocab, device)
        row = keys // vocab
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[row]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[row]
        flat[keys] -= freq * counts + pres


def _mask_banned(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place, step 4 of the pipeline: tokens outside ``allowed_token_ids``, the
    bad words' next tokens, then (during min_tokens) EOS and ``stop_token_ids`` get
    -inf, each ban only where it leaves the row a token (ids outside [0, V) have no
    logit and are ignored)."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids:  # ids the engine checked are < V: one is left
            _ban(logits, i, _deny_mask(p.allowed_token_ids, vocab, logits.device),
                 r.allowed is not None)
        # Without a grammar or an allow-list every logit is finite, so banning fewer
        # ids than the vocabulary always leaves a token: no check needed.
        checked = r.allowed is not None or bool(p.allowed_token_ids)
        if p.bad_words:
            _ban(logits, i, bad_word_ends(p.bad_words, r.output_token_ids), checked)
        if r.num_output_tokens < p.min_tokens:
            _ban(logits, i, [*r.eos_token_ids, *p.stop_token_ids], checked)


@functools.lru_cache(maxsize=256)
def _deny_mask(allowed: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """The bool [V] mask of the tokens outside ``allowed`` (a request's list, cached:
    it is the same every step, and building it from thousands of ids costs a ms)."""
    deny = torch.ones(vocab, dtype=torch.bool, device=device)
    deny[torch.tensor([t for t in allowed if t < vocab], dtype=torch.long, device=device)] = False
    return deny


def bad_word_ends(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``words`` after ``output``: a word's last
    token where the output ends with the rest of it (a one-token word: always)."""
    ends = []
    for w in words:
        head = len(w) - 1
        if head <= len(output) and list(output[len(output) - head:]) == list(w[:head]):
            ends.append(w[-1])
    return ends


def _ban(logits: torch.Tensor, i: int, tokens: torch.Tensor | Sequence[int],
         checked: bool) -> None:
    """Row ``i``'s ``tokens`` (a bool mask or ids) get -inf; ``checked``: unless that
    leaves none."""
    vocab = logits.shape[1]
    if isinstance(tokens, torch.Tensor):  # a bool [V] mask
        if not checked:
            logits[i].masked_fill_(tokens, -math.inf)
            return
        kept = logits[i].masked_fill(tokens, -math.inf)
    else:
        ids = [t for t in tokens if 0 <= t < vocab]
        if not ids:
            return
        if not checked and len(ids) < vocab:
            logits[i, ids] = -math.inf
            return
        kept = logits[i].clone()
        kept[ids] = -math.inf
    if bool(torch.isfinite(kept).any()):
        logits[i] = kept


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow], fast: bool) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row. ``logits`` is a copy."""
    device = logits.device
    params = [r.params for r in rows]
    temps = torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params], device=device)
    logits.div_(temps[:, None])
    _top_k_top_p(logits, params, fast)
    if any(p.min_p > 0.0 for p in params):
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
        log_min_p = torch.tensor([p.min_p for p in params], device=device).log()[:, None]
        cutoff = logits.max(dim=-1, keepdim=True).values + log_min_p
        logits.masked_fill_(logits < cutoff, -math.inf)

    probs = logits.softmax(dim=-1)
    u = torch.empty(len(rows), dtype=torch.float64, device=device)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j] = _draw(r.generator)
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    k = kernels.load() if fast and device.type == "cpu" else None
    if k is None:
        return _inverse_cdf(probs, u)
    chosen = k.inverse_cdf_rows(probs, u)  # the same tokens, one pass a row
    odd = (chosen < 0).nonzero().squeeze(1)  # no mass or a NaN: the reference's answer
    if len(odd):
        chosen[odd] = _inverse_cdf(probs[odd], u[odd])
    return chosen


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF, one uniform per row (what torch.multinomial does, without its
    shared RNG): the first token whose cumulative mass exceeds u * total. A
    zero-probability token never qualifies (its cdf equals its predecessor's).
    float64 keeps tail tokens' share of the cdf exact enough."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1)
    if bool((chosen >= cdf.shape[1]).any()):
        # u * total rounded up to total: take the last token that has mass.
        chosen = torch.minimum(chosen, (cdf < cdf[:, -1:]).sum(dim=-1))
    return chosen


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams], fast: bool) -> None:
    """In place: -inf outside each row's top-k, then outside its top-p nucleus.

    Reference: one full descending sort per row. Fast: only the best ``width``
    candidates (``torch.topk``), where width = the largest top_k, or at least
    _TOP_P_CANDIDATES when some row uses top-p without top-k; if such a row's
    nucleus is wider than its candidates, that row falls back to the full sort.
    """
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    idx = [j for j, p in enumerate(params) if ks[j] < vocab or p.top_p < 1.0]
    if not idx:
        return
    sub = logits[idx]
    k_t = torch.tensor([ks[j] for j in idx], device=logits.device)
    # top_p == 1 gets an infinite threshold so cdf rounding never drops a token.
    p_t = torch.tensor(
        [params[j].top_p if params[j].top_p < 1.0 else math.inf for j in idx],
        device=logits.device,
    )
    width = vocab
    if fast:
        width = max((k for k in ks if k < vocab), default=1)
        if bool((k_t == vocab).any()):
            width = max(width, _TOP_P_CANDIDATES)
        width = min(width, vocab)
    kept, short = _filter_sorted(sub, k_t, p_t, width)
    if width < vocab and bool(short.any()):
        again = short.nonzero().squeeze(1)
        kept[again] = _filter_sorted(sub[again], k_t[again], p_t[again], vocab)[0]
    logits[idx] = kept


def _filter_sorted(
    logits: torch.Tensor, k_t: torch.Tensor, p_t: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p using the best ``width`` tokens of each row.

    Returns the filtered logits and a bool per row: True where the row uses top-p
    without top-k and its nucleus is wider than ``width`` (that row's result is
    then wrong and must be redone with width == V).
    """
    vocab = logits.shape[1]
    if width < vocab:
        vals, order = logits.topk(width, dim=-1)  # sorted, best first
    else:
        vals, order = logits.sort(dim=-1, descending=True)
    vals.masked_fill_(torch.arange(width, device=logits.device)[None, :] >= k_t[:, None], -math.inf)
    # Normaliser over what top-k keeps: the candidates when top-k is on (k <= width),
    # the whole row otherwise.
    lse = torch.where(k_t < vocab, vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (vals - lse[:, None]).exp()
    cum = probs.cumsum(dim=-1)
    short = (
        (k_t == vocab) & (cum[:, -1] < p_t)
        if width < vocab
        else torch.zeros_like(k_t, dtype=torch.bool)
    )
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
    # strictly before it is already >= top_p (the best token always stays).
    drop = (cum - probs) >= p_t[:, None]
    drop[:, 0] = False
    vals.masked_fill_(drop, -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(1, order, vals), short


def token_logprobs(raw_logits: torch.Tensor, token_ids: Sequence[int],
                   n_top: int) -> list[TokenLogprob]:
    """Raw-model logprob, rank and top-``n_top`` of ``token_ids[i]`` under row i."""
    lp = torch.log_softmax(raw_logits, dim=-1)
    chosen = torch.tensor(list(token_ids), device=lp.device)[:, None]
    chosen_lp = lp.gather(1, chosen)
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = lp.topk(min(n_top, lp.shape[1]), dim=-1)  # sorted, best first
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    chosen_l = chosen_lp.squeeze(1).tolist()
    return [TokenLogprob(t, chosen_l[j], list(zip(top_ids_l[j], top_vals_l[j], strict=True)),
                         ranks[j])
            for j, t in enumerate(token_ids)]


def _logprobs(
    raw_logits: torch.Tensor, token_ids: Sequence[int], rows: Sequence[SamplingRow]
) -> list[TokenLogprob | None]:
    """Raw-model logprobs of the sampled tokens (and top-N) for rows that ask."""
    result: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return result
    n_top = max(rows[i].params.logprobs or 0 for i in want)
    got = token_logprobs(raw_logits[want], [token_ids[i] for i in want], n_top)
    for i, lp in zip(want, got, strict=True):
        n = rows[i].params.logprobs or 0
        result[i] = lp._replace(top=lp.top[:n])
    return result
