"""Continuous batching under a token budget.

One rule drives everything: each step, every scheduled request's computed tokens
catch up with its total tokens, as far as the step's token budget allows. A new
prompt is a request far behind (chunked prefill is the budget cutting it short), a
decoding request is one token behind, a prefix-cache hit starts a request with
tokens already computed, and a preempted request drops back to zero computed
tokens (recomputation) while keeping the tokens it generated.

Roles: ``colocated`` runs requests to completion; ``prefill`` parks a request as
PREFILLED after its first token, keeping its blocks for hand-off; ``decode``
additionally accepts requests whose KV arrives from outside into reserved blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.block_pool import ROOT_HASH, BlockPool, hash_block
from pdserve.engine.config import ceil_div
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What the runner computes this step (filled by ``Scheduler.schedule``)."""

    work: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)

    def __bool__(self) -> bool:
        return bool(self.work)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int,
                 on_release: Callable[[Request], None] = lambda req: None) -> None:
        self.pool = pool
        # Told whenever a request stops being computed with its current blocks
        # (freed, preempted, or parked for hand-off): the runner reuses its row.
        self.on_release = on_release
        self.block_size = block_size
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---------------------------------------------------------------- intake
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def reserve(self, req: Request) -> list[int] | None:
        """Decode role: allocate blocks for the prompt's KV, written from outside.
        ``None`` when there is no room (the caller waits or tries elsewhere)."""
        if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs:
            return None
        blocks = self.pool.allocate(ceil_div(req.num_prompt_tokens, self.block_size))
        if blocks is None:
            return None
        req.block_ids = blocks
        req.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv[req.request_id] = req
        return blocks

    def start_decode(self, req: Request) -> None:
        """Decode role: the prompt's KV is in ``req.block_ids``; the caller appended
        the first token. From here the request decodes like any other."""
        del self.waiting_for_kv[req.request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self._register_full_blocks(req)
        self.running.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_new_tokens, budget)
            if not self._grow_or_preempt(req, n, batch):
                break  # req itself was preempted; it was the lowest priority left
            batch.work.append((req, n))
            budget -= n
            i += 1
        if batch.preempted:  # no admissions in a step that had to preempt
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.block_ids:
                self._take_prefix_hits(req)
            n = min(req.num_new_tokens, budget)
            if not self._grow(req, n):
                self._release_blocks(req)  # a waiting request holds only prefix hits
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.work.append((req, n))
            budget -= n
        return batch

    def _take_prefix_hits(self, req: Request) -> None:
        # At least one token must be computed to get logits, so only full blocks
        # inside the first num_tokens - 1 tokens may be hits. Prompt logprobs need
        # every prompt position computed: no hits.
        if req.params.prompt_logprobs is not None:
            return
        hashes = self._block_hashes(req, (req.num_tokens - 1) // self.block_size)
        hits = self.pool.lookup(hashes)
        if hits:
            self.pool.acquire(hits)
            req.block_ids = list(hits)
            req.num_computed_tokens = len(hits) * self.block_size
            req.num_registered_blocks = len(hits)
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def _grow(self, req: Request, n: int) -> bool:
        need = ceil_div(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        return True

    def _grow_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        while not self._grow(req, n):
            victim = self.running.pop()  # the most recently admitted goes first
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self._release_blocks(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release_blocks(self, req: Request) -> None:
        self.on_release(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    # ---------------------------------------------------------- after a step
    def advance(self, req: Request, n: int) -> None:
        """The runner computed ``n`` more tokens of ``req``."""
        req.num_computed_tokens += n
        self._register_full_blocks(req)

    def _register_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        hashes = self._block_hashes(req, full)
        for idx in range(req.num_registered_blocks, full):
            self.pool.register(req.block_ids[idx], hashes[idx])
        req.num_registered_blocks = full

    def _block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_blocks`` full blocks, computed once per
        block over the request's life (tokens of a full block never change)."""
        bs, hashes = self.block_size, req.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else ROOT_HASH
            start = len(hashes) * bs
            hashes.append(hash_block(parent, req.token_ids[start : start + bs]))
        return hashes[:num_blocks]

    def finish(self, req: Request, keep_blocks: bool = False) -> None:
        """Take ``req`` out of the queues. ``keep_blocks`` parks its KV (prefill
        role hand-off) until ``release``."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.waiting_for_kv.pop(req.request_id, None)
        if keep_blocks:
            self.on_release(req)
            req.status = RequestStatus.PREFILLED
        else:
            self._release_blocks(req)
            req.status = RequestStatus.FINISHED

    def release(self, req: Request) -> None:
        """Free the blocks of a PREFILLED request once its KV was handed off."""
        self._release_blocks(req)
        req.status = RequestStatus.FINISHED
