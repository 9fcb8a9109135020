"""``Drafting``: each step's speculative drafts, before the step verifies them
(``spec_decode.py`` has the methods and their rules): n-gram / suffix proposals per
request, a draft model's batched guesses (their lengths adapted to the measured cost of
a draft token against a decoding step), every draft cut where its request's grammar
stops allowing it, and under tensor parallelism rank 0's drafts and cuts shared so every
rank verifies the same tokens.

A mixin of ``LLMEngine`` (its state, declared below for the type checker)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.sampling.sampler import own_generator

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.spec.draft_model import DraftModel
    from pdserve.engine.tp.collectives import TPGroup


class Drafting:
    if TYPE_CHECKING:  # the engine's, used here
        config: EngineConfig
        scheduler: Scheduler
        draft: DraftModel | None
        draft_model_id: str | None
        tp: TPGroup | None
        _decode_step_s: float

    def _propose(self, max_batch: int) -> None:
        """Drafts for this step's decoding requests (none in a batch over ``max_batch``
        requests, or for a request not one token behind)."""
        on = len(self.scheduler.running) <= max_batch
        drafting: list[tuple[Request, int]] = []  # draft model: (request, k), batched
        cost = self._draft_cost()
        for req in self.scheduler.running:
            if not on or req.spec is None or req.num_new_tokens != 1:
                req.spec_token_ids.clear()
                continue
            # All of a draft accepted, plus one: still within max_tokens.
            room = req.params.max_tokens - req.num_output_tokens - 1
            if self.draft_model_id is None:
                req.spec_token_ids = req.spec.propose(req.token_ids, room)
                continue
            req.spec_token_ids = []
            k = req.spec.draft_length(room, cost)
            if k:
                if req.generator is None and not req.params.greedy and self.draft is not None:
                    req.generator = own_generator(self.config.device)  # the draft reads ahead
                drafting.append((req, k))
        if drafting:
            drafts = None if self.draft is None else self.draft.propose(drafting)
            if self.tp is not None:
                drafts = self._share_drafts(drafting, drafts)
            assert drafts is not None
            for (req, _), draft in zip(drafting, drafts, strict=True):
                req.spec_token_ids = draft
        self._within_grammars()

    def _draft_cost(self) -> float:
        """A draft model's token as a fraction of a decoding step, measured (0: not yet
        measured, or tensor parallel, where every rank must pick the same lengths)."""
        if self.draft is None or self.tp is not None or not self._decode_step_s:
            return 0.0
        return self.draft.forward_s / self._decode_step_s

    def _within_grammars(self) -> None:
        """Cut each structured-output request's draft at the first token its grammar
        does not allow there (verification could never accept it or what follows).
        Under tensor parallelism the grammars are rank 0's: it tells the others where."""
        cut = [req for req in self.scheduler.running
               if req.params.structured is not None and req.spec_token_ids]
        if not cut:
            return
        lengths = None
        if self.tp is None or self.tp.rank == 0:
            lengths = [req.grammar.validate_tokens(req.spec_token_ids)  # type: ignore[union-attr]
                       for req in cut]
        if self.tp is not None:
            lengths = self.tp.broadcast_ints(lengths, len(cut))
        assert lengths is not None
        for req, n in zip(cut, lengths, strict=True):
            del req.spec_token_ids[n:]

    def _share_drafts(self, drafting: list[tuple[Request, int]],
                      drafts: list[list[int]] | None) -> list[list[int]]:
        """Rank 0's drafts on every tensor-parallel rank (each rank knows the lengths
        asked for: its requests and their adaptive states are the same)."""
        assert self.tp is not None
        n = sum(k for _, k in drafting)
        flat = None if drafts is None else [t for (_, k), d in zip(drafting, drafts, strict=True)
                                            for t in d + [-1] * (k - len(d))]
        got = self.tp.broadcast_ints(flat, n)
        out, at = [], 0
        for _, k in drafting:
            out.append([t for t in got[at : at + k] if t >= 0])
            at += k
        return out
