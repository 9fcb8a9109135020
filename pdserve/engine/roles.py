"""``DisaggregatedRoles``: what the prefill and decode workers call on an ``LLMEngine``
beyond the colocated ``add_request`` / ``step`` (the engine's docstring tells the two
roles' lifecycles): reserving a prompt's blocks for KV computed elsewhere and starting
it when the KV is in, computing a reserved prompt's suffix here instead, the draft
model's share, the blocks a transfer reads (and pins), and releasing a hand-off.

A mixin of ``LLMEngine`` (its state and helpers, declared below for the type checker);
the state-changing calls are ``@replicated`` like the engine's own, so tensor-parallel
followers replay them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.request import RequestStatus
from pdserve.engine.results import RequestOutput
from pdserve.engine.runner import Sampled
from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.sampler import skip_draws
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.stop import StopChecker
from pdserve.engine.tp.lockstep import replicated

if TYPE_CHECKING:
    from pdserve.engine.block_pool import BlockPool
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.spec.draft_model import DraftModel


class DisaggregatedRoles:
    if TYPE_CHECKING:  # the engine's, used here
        requests: dict[str, Request]
        scheduler: Scheduler
        pool: BlockPool
        draft: DraftModel | None
        draft_model_id: str | None
        block_size: int
        kv_cache: torch.Tensor
        eos_token_ids: frozenset[int]
        _stops: dict[str, StopChecker]

        def _new_request(self, request_id: str, prompt_token_ids: Sequence[int],
                         params: SamplingParams) -> Request: ...
        def _forget(self, request_id: str) -> None: ...
        def _append_tokens(self, s: Sampled) -> RequestOutput: ...

    @replicated
    def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                params: SamplingParams) -> list[int] | None:
        """Decode role: blocks for the prompt's KV, or ``None`` when full."""
        req = self._new_request(request_id, prompt_token_ids, params)
        blocks = self.scheduler.reserve(req)
        if blocks is None:
            self._forget(request_id)
        return blocks

    @replicated
    def prefill_reserved(self, request_id: str) -> None:
        """Decode role: compute the rest of a reserved prompt here (the blocks its
        reservation shared from this engine's prefix cache, then a prefill chunk of
        what is left) instead of receiving its KV; its first token comes from this
        engine's next step, sampled here, as a colocated engine's."""
        req = self.requests[request_id]
        if req.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not waiting for KV")
        self.scheduler.prefill_reserved(req)

    @replicated
    def start_decode(self, request_id: str, first_token: int,
                     first_logprobs: TokenLogprob | None = None) -> RequestOutput:
        """Decode role: the prompt's KV is in the reserved blocks; ``first_token``
        was sampled by the prefill worker. Returns that token's output."""
        req = self.requests[request_id]
        if req.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not waiting for KV")
        if req.grammar is not None and req.grammar.validate_tokens([first_token]) != 1:
            raise ValueError(f"request {request_id!r}: first token {first_token} does not "
                             f"match its structured output constraint")
        self.scheduler.start_decode(req)
        if self.draft is not None:  # the draft's prompt KV came too, if it reserved any
            self.draft.adopt(request_id, req.prompt_token_ids)
        skip_draws(req.params, req.generator, 1)  # the prefill worker drew the first token
        return self._append_tokens(Sampled(req, [first_token],
                                           [] if first_logprobs is None else [first_logprobs]))

    @replicated
    def reserve_more(self, request_id: str, n: int) -> bool:
        """Decode role: ``n`` blocks more for a reserved request (a moved request's
        tokens made while it moves); False when there is no room."""
        req = self.requests[request_id]
        blocks = self.pool.allocate(n)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        return True

    @replicated
    def start_moved(self, request_id: str, more_tokens: Sequence[int] = ()) -> None:
        """Decode role: the KV of a request moved from another decode worker is in its
        reserved blocks, but for its last token's. ``more_tokens``: those it made there
        after this reservation was made -- they join its prompt as an earlier attempt's
        output (``resumed_tokens``: grammar, seeded draws and budgets go on after
        them). That last token's KV is computed and the next token sampled by this
        engine's next step (``Scheduler.start_moved``). ``ValueError`` when the tokens
        do not fit the reservation or break its grammar."""
        req = self.requests[request_id]
        if req.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not waiting for KV")
        if more_tokens:
            self._resume_more(req, list(more_tokens))
        self.scheduler.start_moved(req)

    def _resume_more(self, req: Request, more: list[int]) -> None:
        k, p = len(more), req.params
        if req.num_tokens + k > len(req.block_ids) * self.block_size or k >= p.max_tokens:
            raise ValueError(f"request {req.request_id!r}: {k} tokens more do not fit its "
                             f"reservation")
        if req.grammar is not None and req.grammar.validate_tokens(more) != k:
            raise ValueError(f"request {req.request_id!r}: its moved tokens do not match its "
                             f"structured output constraint")
        req.params = dataclasses.replace(p, max_tokens=p.max_tokens - k,
                                         min_tokens=max(0, p.min_tokens - k),
                                         resumed_tokens=p.resumed_tokens + k)
        req.prompt_token_ids.extend(more)
        req.token_ids.extend(more)
        if req.grammar is not None:
            for token in more:
                req.grammar.consume_token(token)
        skip_draws(req.params, req.generator, k)
        self._stops[req.request_id] = StopChecker(req.params, self.eos_token_ids)

    @replicated
    def reserve_draft(self, request_id: str) -> list[int]:
        """Decode role, after ``reserve``: the draft model's blocks for the prompt's
        draft KV, which the prefill worker sends with the target's ([] without a draft
        model, for a request that does not speculate, or with no room: its draft then
        catches up on the prompt here; for a draft of this engine's own checkpoint,
        which copies the target's prompt KV here, none is sent)."""
        req = self.requests[request_id]
        if self.draft is None or req.spec is None or self.draft.target_kv is not None:
            return []
        return self.draft.reserve(request_id, req.num_prompt_tokens)

    @replicated
    def prefill_draft(self, request_ids: Sequence[str]) -> None:
        """Prefill role: compute the draft model's KV of these PREFILLED requests'
        prompts, into the draft cache at the target's blocks (``block_ids``), where
        the transfer reads it."""
        if self.draft_model_id is None:
            raise ValueError("prefill_draft: this engine has no draft model")
        reqs = [self.requests[rid] for rid in request_ids]
        for req in reqs:
            if req.status is not RequestStatus.PREFILLED:
                raise ValueError(f"request {req.request_id!r} is {req.status.value}, "
                                 "not prefilled")
        if self.draft is not None:  # (a tensor-parallel follower: rank 0's draft)
            self.draft.prefill([(r.request_id, r.prompt_token_ids, r.block_ids) for r in reqs])

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.requests[request_id].block_ids)

    def computed_blocks(self, request_id: str) -> list[int]:
        """The request's full blocks whose KV is computed so far ([] when unknown):
        what a prefill worker may send before the prompt is done."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        return list(req.block_ids[:req.num_computed_tokens // self.block_size])

    def empty_blocks(self, block_ids: Sequence[int]) -> list[int]:
        """The blocks among ``block_ids`` that hold no KV: the first token slot of the
        first layer's keys all zero, which no computed key is (a few bytes read per
        block). A block a transfer never wrote, or one sent before it was computed."""
        if not block_ids:
            return []
        first = self.kv_cache[torch.tensor(list(block_ids)), 0, 0, :, 0]
        empty = ~first.reshape(len(block_ids), -1).any(dim=1)
        return [b for b, e in zip(block_ids, empty.tolist(), strict=True) if e]

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens the prefix cache served (a reservation's shared blocks)."""
        return self.requests[request_id].num_cached_tokens

    @replicated
    def pin(self, block_ids: Sequence[int]) -> None:
        """Hold these blocks (a transfer reads them) until ``unpin``: on every rank, so
        every rank's pool hands out the same blocks next."""
        self.pool.acquire(list(block_ids))

    @replicated
    def unpin(self, block_ids: Sequence[int]) -> None:
        self.pool.free(list(block_ids))

    @replicated
    def release(self, request_id: str) -> None:
        """Prefill role: free a PREFILLED request's blocks after hand-off
        (idempotent; unknown ids are ignored)."""
        req = self.requests.pop(request_id, None)
        self._stops.pop(request_id, None)
        if req is not None and req.status is RequestStatus.PREFILLED:
            self.scheduler.release(req)
