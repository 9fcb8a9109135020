"""Runs one ``ScheduledBatch``: step inputs from the persistent ``InputBatch``,
the model on the KV cache, and the sampler for the requests that caught up with
their tokens this step.

A request that verifies a draft (``spec_decode.py``) has one logits row per draft
token after its own; ``verify`` keeps the tokens the model agrees with.

The token masks of structured-output requests are computed on a helper thread while
the model runs (llguidance releases the GIL, as torch's kernels do), so a grammar
costs the step only what outlasts the forward pass."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from pdserve.engine.input_batch import InputBatch
from pdserve.engine.model.model import LlamaModel
from pdserve.engine.request import Request
from pdserve.engine.sampling.grammar import Grammars
from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.sampler import Sampler, SamplingRow, token_logprobs
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.spec.spec_decode import Verified, verify

PROMPT_LOGITS_ROWS = 512  # prompt positions turned into logits at once


@dataclass
class Sampled:
    """A request's tokens from one step: its accepted draft tokens, then one sampled."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token where the request asked, else []
    num_draft: int = 0  # draft tokens it verified (accepted: len(token_ids) - 1)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, inputs: InputBatch,
                 eos_token_ids: frozenset[int], grammars: Grammars) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.inputs = inputs
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._mask_thread: ThreadPoolExecutor | None = None

    def _start_masks(self, sampled: list[Request], drafts: list[list[int]],
                     ) -> tuple[list[int], Future[list[torch.Tensor]]] | None:
        rows = [i for i, r in enumerate(sampled) if r.grammar is not None]
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        work = [(sampled[i].grammar, drafts[i]) for i in rows]
        return rows, self._mask_thread.submit(self._masks, work)  # type: ignore[arg-type]

    def _masks(self, work: list[tuple[llguidance.LLMatcher, list[int]]]) -> list[torch.Tensor]:
        """Per request, the masks of its 1 + len(draft) positions ([1 + k, words]):
        position j's is its grammar's after the draft's first j tokens (copies of the
        matcher advance over them; the request's own is advanced as tokens are kept)."""
        matchers: list[llguidance.LLMatcher] = []
        for m, draft in work:
            matchers.append(m)
            at = m
            for t in draft:  # allowed: the engine cut the draft to what the grammar takes
                at = at.deep_copy()
                ok = at.consume_token(t)
                assert ok, at.get_error()
                matchers.append(at)
        return list(self.grammars.fill(matchers).split([1 + len(d) for _, d in work]))

    def execute(self, batch: ScheduledBatch) -> list[Sampled]:
        """Run the step; prompt logprobs land in each request's ``prompt_logprobs``."""
        step = self.inputs.prepare(batch.work)
        masks = self._start_masks(step.sampled, step.drafts)
        hidden = self.model(step.input_ids, self.kv_cache, step.meta, step.logits_indices)
        n = len(step.sampled)
        widths = [1 + len(d) for d in step.drafts]  # logits rows per sampled request
        num_rows = sum(widths)
        if step.prompt_targets:
            self._prompt_logprobs(hidden[num_rows:], step.prompt_targets)
        if not n:
            return []
        logits = self.model.logits(hidden[:num_rows])
        tp = self.model.tp
        if logits is None:  # a tensor-parallel follower: rank 0 samples for every rank
            assert tp is not None
            flat = tp.broadcast_ints(None, num_rows)
            kept, at = [], 0
            for w in widths:  # each request's tokens, padded with -1 to its width
                kept.append(Verified([t for t in flat[at : at + w] if t >= 0], []))
                at += w
        else:
            rows = [SamplingRow(r.params, r.token_ids, r.num_prompt_tokens, r.generator,
                                self.eos_token_ids) for r in step.sampled]
            allowed: list[torch.Tensor | None] = [None] * n  # per request: [1 + k, words]
            if masks is not None:
                for i, mask in zip(masks[0], masks[1].result(), strict=True):
                    allowed[i] = mask
                    rows[i].allowed = mask[0]
            if num_rows == n:
                out = self.sampler(logits, rows)
                kept = [Verified([t], [] if lp is None else [lp])
                        for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
            else:
                kept = verify(self.sampler, logits, rows, step.drafts, allowed)
            if tp is not None:
                tp.broadcast_ints([t for v, w in zip(kept, widths, strict=True)
                                   for t in v.token_ids + [-1] * (w - len(v.token_ids))],
                                  num_rows)
        return [Sampled(r, v.token_ids, v.logprobs, len(d))
                for r, v, d in zip(step.sampled, kept, step.drafts, strict=True)]

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         targets: list[tuple[Request, list[int]]]) -> None:
        # The logits of a long prompt are large (rows x vocab floats): a slice at a time.
        tokens = [t for _, ts in targets for t in ts]
        owners = [r for r, ts in targets for _ in ts]
        for lo in range(0, len(tokens), PROMPT_LOGITS_ROWS):
            hi = min(lo + PROMPT_LOGITS_ROWS, len(tokens))
            logits = self.model.logits(hidden[lo:hi])
            if logits is None:  # a tensor-parallel follower: rank 0 keeps the logprobs
                continue
            n_top = max(r.params.prompt_logprobs or 0 for r in owners[lo:hi])
            for req, lp in zip(owners[lo:hi], token_logprobs(logits, tokens[lo:hi], n_top),
                               strict=True):
                keep = req.params.prompt_logprobs or 0
                req.prompt_logprobs.append(lp._replace(top=lp.top[:keep]))
