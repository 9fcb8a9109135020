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

Order of admission from the WAITING queue (``params.priority``, vLLM's field: lower
runs first). The queue is one FIFO per priority (``waiting`` holds them interleaved,
in arrival order, a preempted request back at the front); each step admits the head
of the FIFO whose *effective* priority is lowest, ``effective_priority(priority,
now - arrival_time)`` = ``priority - floor(waited / AGING_S)``: every ``AGING_S``
seconds of waiting is worth one priority level, so a low priority is served once
it has waited long enough (no starvation) while a high one still goes first when
both are fresh. Ties go to the head nearer the front of ``waiting``. Within one
priority the order is exactly FIFO, so with every priority 0 (the default) the
order is today's. As before, a head that does not fit stops admission for the step
(nothing behind it bypasses it). Running requests are never preempted for a better
priority: preemption still takes the most recently admitted (left for later).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.engine.block_pool import BlockPool, hash_block, root_hash
from pdserve.engine.config import ceil_div
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.results import StepInfo
from pdserve.engine.sampling.sampling_params import effective_priority

# Seconds of waiting worth one priority level (see the module doc). The router's
# admission queue (router/admission.py) ages waiters by the same rule.



@dataclass
class ScheduledBatch:
    """What the runner computes this step (filled by ``Scheduler.schedule``)."""

    work: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)

    def step_info(self, seconds: float = 0.0) -> StepInfo:
        """The step's shape (before its tokens are advanced): what its metrics and the
        step-time models read."""
        return StepInfo(num_seqs=len(self.work), num_tokens=self.num_tokens,
                        num_decode=sum(1 for _, n in self.work if n == 1),
                        context_tokens=sum(r.num_computed_tokens + n for r, n in self.work),
                        seconds=seconds,
                        prompt_pairs=sum(n * r.num_computed_tokens + n * (n + 1) / 2
                                         for r, n in self.work if n > 1))

    def __bool__(self) -> bool:
        return bool(self.work)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int,
                 on_release: Callable[[Request], None] = lambda req: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        # Told whenever a request stops being computed with its current blocks
        # (freed, preempted, or parked for hand-off): the runner reuses its row.
        self.on_release = on_release
        self.block_size = block_size
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        # priority -> requests of it in ``waiting`` (one priority: plain FIFO, no scan)
        self._waiting_priorities: Counter[int] = Counter()
        self._clock = clock  # monotonic, like Request.arrival_time
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---------------------------------------------------------------- intake
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self._waiting_priorities[req.params.priority] += 1

    def reserve(self, req: Request) -> list[int] | None:
        """Decode role: blocks for the prompt's KV, written from outside -- except the
        leading full blocks this pool's prefix cache holds already (a conversation's
        earlier turns), which are shared (``num_cached_tokens`` says how many tokens;
        the block of the prompt's last token is always fresh, so something is always
        sent). ``None`` when there is no room (the caller waits or tries elsewhere)."""
        if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs:
            return None
        hits = self._cached_prefix(req)
        self.pool.acquire(hits)  # before allocating: an allocation may evict cached blocks
        blocks = self.pool.allocate(ceil_div(req.num_prompt_tokens, self.block_size) - len(hits))
        if blocks is None:
            self.pool.free(hits)
            return None
        req.block_ids = [*hits, *blocks]
        req.num_cached_tokens = len(hits) * self.block_size
        req.num_registered_blocks = len(hits)
        req.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv[req.request_id] = req
        return list(req.block_ids)

    def start_decode(self, req: Request) -> None:
        """Decode role: the prompt's KV is in ``req.block_ids``; the caller appended
        the first token. From here the request decodes like any other."""
        del self.waiting_for_kv[req.request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self._register_full_blocks(req)
        self.running.append(req)

    def prefill_reserved(self, req: Request) -> None:
        """Decode role: a reserved request computes the rest of its prompt here (after
        the shared prefix blocks) instead of receiving its KV: it runs from the next
        step on, its remaining prompt tokens a prefill chunk like any other, in the
        blocks already reserved for them."""
        del self.waiting_for_kv[req.request_id]
        req.num_computed_tokens = req.num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def start_moved(self, req: Request) -> None:
        """Decode role: a request moved here from another decode worker, its KV in
        ``req.block_ids`` for every token but the last (the one sampled last, whose KV
        the next step computes): it runs from the next step on, that token a prefill
        chunk of one, its next token sampled here."""
        del self.waiting_for_kv[req.request_id]
        req.num_computed_tokens = req.num_tokens - 1
        req.status = RequestStatus.RUNNING
        self._register_full_blocks(req)
        self.running.append(req)

    def room_for(self, num_prompt_tokens: int) -> bool:
        """Colocated admission: whether a prompt's blocks fit in the free pool beside
        the blocks the waiting requests still need."""
        bs = self.block_size
        queued = sum(ceil_div(r.num_tokens, bs) - len(r.block_ids) for r in self.waiting)
        return ceil_div(num_prompt_tokens, bs) + queued <= self.pool.num_free

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
            n += self._make_room_for_draft(req, n, budget)
            batch.work.append((req, n))
            budget -= n
            i += 1
        if batch.preempted:  # no admissions in a step that had to preempt
            return batch
        now = self._clock()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            idx, req = self._next_waiting(now)
            if not req.block_ids:
                self._take_prefix_hits(req)
            n = min(req.num_new_tokens, budget)
            if not self._grow(req, n):
                self._release_blocks(req)  # a waiting request holds only prefix hits
                break
            self._take_waiting(idx, req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.work.append((req, n))
            budget -= n
        return batch

    def _next_waiting(self, now: float) -> tuple[int, Request]:
        """The waiting request to admit next and its index (see the module doc)."""
        if len(self._waiting_priorities) <= 1:
            return 0, self.waiting[0]  # one priority: FIFO
        heads: dict[int, tuple[int, Request]] = {}
        for i, r in enumerate(self.waiting):  # the first of each priority is its head
            if r.params.priority not in heads:
                heads[r.params.priority] = (i, r)
                if len(heads) == len(self._waiting_priorities):
                    break
        return min(heads.values(), key=lambda h: (
            effective_priority(h[1].params.priority, now - h[1].arrival_time), h[0]))

    def _take_waiting(self, idx: int, req: Request) -> None:
        if idx == 0:
            self.waiting.popleft()
        else:
            del self.waiting[idx]
        self._forget_priority(req)

    def _forget_priority(self, req: Request) -> None:
        p = req.params.priority
        self._waiting_priorities[p] -= 1
        if self._waiting_priorities[p] <= 0:
            del self._waiting_priorities[p]

    def _take_prefix_hits(self, req: Request) -> None:
        # At least one token must be computed to get logits, so only full blocks
        # inside the first num_tokens - 1 tokens may be hits. Prompt logprobs need
        # every prompt position computed: no hits.
        if req.params.prompt_logprobs is not None:
            return
        hits = self._cached_prefix(req)
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

    def _make_room_for_draft(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens of ``req`` to verify after its ``n`` new tokens: as many of
        ``spec_token_ids`` as the budget and the free blocks allow (a draft never
        preempts anyone); the rest of the draft is dropped."""
        draft = req.spec_token_ids
        if not draft:
            return 0
        k = min(len(draft), budget - n) if n == req.num_new_tokens else 0
        if k > 0 and not self._grow(req, n + k):
            k = 0
        del draft[max(k, 0):]
        return max(k, 0)

    def trim(self, req: Request) -> None:
        """Give back the blocks past the one that receives ``req``'s next token
        (allocated for draft tokens that were rejected)."""
        keep = ceil_div(req.num_computed_tokens + 1, self.block_size)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]

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
        self.waiting.appendleft(req)  # the head of its priority's FIFO
        self._waiting_priorities[req.params.priority] += 1

    def _release_blocks(self, req: Request) -> None:
        self.on_release(req)
        req.spec_token_ids.clear()
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    # ---------------------------------------------------------- after a step
    def advance(self, req: Request, n: int) -> None:
        """The runner computed ``n`` more tokens of ``req``."""
        req.num_computed_tokens += n
        self._register_full_blocks(req)

    def grow_for_decode(self, reqs: Sequence[Request]) -> None:
        """The blocks the next decode step of ``reqs`` writes into, taken now, as
        ``schedule`` takes them when that step starts (for the simulator's steady runs,
        whose steps are applied later: the caller knows they fit)."""
        for req in reqs:
            if not self._grow(req, 1):
                raise RuntimeError(f"grow_for_decode: no free block for {req.request_id!r}")

    def decode_steps(self, reqs: Sequence[Request], k: int) -> None:
        """``k`` decode steps of ``reqs`` at once, for a caller that knows nothing else
        would happen in them (the simulator's steady runs: nobody waiting, finishing,
        or short of a block): each grows and advances by ``k``, taking the blocks and
        registering the full blocks ``k`` single steps would. Their ``k`` new tokens
        are appended first."""
        bs = self.block_size
        for req in reqs:
            computed = req.num_computed_tokens + k
            if computed > len(req.block_ids) * bs and not self._grow(req, k):
                raise RuntimeError(f"decode_steps: no free block for {req.request_id!r}")
            req.num_computed_tokens = computed
            if computed // bs > req.num_registered_blocks:
                self._register_full_blocks(req)

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks holding the longest prefix of ``req``'s tokens but its
        last (at least one token is computed, for its logits); none without a prefix
        cache (nothing hashed)."""
        if not self.pool.enable_prefix_caching:
            return []
        return self.pool.lookup(self._block_hashes(req, (req.num_tokens - 1) // self.block_size))

    def _register_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        if not self.pool.enable_prefix_caching:  # nothing is looked up: nothing hashed
            req.num_registered_blocks = full
            return
        hashes = self._block_hashes(req, full)
        start = req.num_registered_blocks
        self.pool.register(req.block_ids[start:full], hashes[start:full])
        req.num_registered_blocks = full

    def _block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_blocks`` full blocks, computed once per
        block over the request's life (tokens of a full block never change)."""
        bs, hashes = self.block_size, req.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else root_hash(req.params.cache_salt)
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
            self._forget_priority(req)
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
