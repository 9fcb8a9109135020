"""Routing policies: pure functions of a cluster snapshot and one request.

Each returns (prefill worker id, token worker ids in order of preference). Token
workers are the decode workers and the colocated ones, ranked together: admission
reserves on the first with room; for a decode worker it then asks the policy again
with the prefill workers connected to it to pick P (None when there are none).
Nothing here talks to a worker or keeps state: the snapshot carries the router's own
fresh counters (tokens and requests it dispatched and has not seen finish, blocks it
reserved that the last report does not show) beside the workers' last reported load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    outstanding_tokens: int = 0  # prefill: prompt tokens dispatched, not yet prefilled
    outstanding_requests: int = 0  # requests dispatched, not yet finished
    free_blocks: int = 0  # token workers: allocatable KV blocks (reported - claimed since)
    total_blocks: int = 1
    colocated: bool = False  # a colocated worker (prefills its own requests)


@dataclass(frozen=True)
class ClusterSnapshot:
    prefill: Sequence[WorkerView]  # live prefill workers (may be empty)
    decode: Sequence[WorkerView]  # live token workers: decode and colocated
    sequence: int = 0  # requests routed so far (round-robin position)
    # prefix-affinity: which prefill worker last saw each prompt block hash
    prefix_owner: dict[int, str] = field(default_factory=dict)
    # ... and which token worker (decode, colocated) last held each block hash
    token_prefix_owner: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteInput:
    num_prompt_tokens: int
    block_hashes: Sequence[int]  # chained hashes of the prompt's full blocks
    share_prefix: bool = False  # its prompt was just prefilled: prefix affinity, any policy
    block_size: int = 16  # tokens per KV block (the workers' own: ClusterConfig.block_size)


Choice = tuple[str | None, list[str]]
Policy = Callable[[ClusterSnapshot, RouteInput], Choice]


def _decode_by_room(snap: ClusterSnapshot) -> list[str]:
    ranked = sorted(snap.decode, key=lambda w: (-w.free_blocks / max(1, w.total_blocks),
                                                w.outstanding_requests, w.worker_id))
    return [w.worker_id for w in ranked]


def _least_loaded_prefill(workers: Sequence[WorkerView]) -> str | None:
    if not workers:
        return None
    return min(workers, key=lambda w: (w.outstanding_tokens, w.outstanding_requests,
                                       w.worker_id)).worker_id


def round_robin(snap: ClusterSnapshot, req: RouteInput) -> Choice:
    p = snap.prefill[snap.sequence % len(snap.prefill)].worker_id if snap.prefill else None
    d = len(snap.decode)
    order = [snap.decode[(snap.sequence + i) % d].worker_id for i in range(d)]
    return p, order


def least_loaded(snap: ClusterSnapshot, req: RouteInput) -> Choice:
    """Prefill: fewest queued prompt tokens. Decode: most free KV blocks."""
    return _least_loaded_prefill(snap.prefill), _decode_by_room(snap)


def _longest_owner(owners: dict[int, str], hashes: Sequence[int],
                   live: set[str]) -> tuple[str | None, int]:
    """The live worker that last held the longest prefix of ``hashes``, and its length."""
    best, best_len = None, 0
    for i, h in enumerate(hashes):
        owner = owners.get(h)
        if owner is None:
            break
        if owner in live:
            best, best_len = owner, i + 1
    return best, best_len


def _decode_by_prefix(snap: ClusterSnapshot, req: RouteInput) -> list[str]:
    """Most free blocks first, except that the token worker holding the longest prefix
    of the prompt (a conversation's earlier turns: its KV is not sent again, or not
    recomputed) goes first when it has room for the rest."""
    order = _decode_by_room(snap)
    live = {w.worker_id: w for w in snap.decode}
    best, held = _longest_owner(snap.token_prefix_owner, req.block_hashes, set(live))
    need = -(-req.num_prompt_tokens // req.block_size) - held
    if best is None or live[best].free_blocks < need:
        return order
    return [best, *(w for w in order if w != best)]


def prefix_affinity(snap: ClusterSnapshot, req: RouteInput) -> Choice:
    """Prefill: the worker that last prefilled the longest prefix of this prompt
    (its prefix cache most likely holds it), unless it is far busier than the
    least-loaded one; otherwise least-loaded. Decode: the one holding the longest
    prefix if it has room, else most free blocks."""
    live = {w.worker_id: w for w in snap.prefill}
    best, best_len = _longest_owner(snap.prefix_owner, req.block_hashes, set(live))
    fallback = _least_loaded_prefill(snap.prefill)
    if best is None or fallback is None:
        return fallback, _decode_by_prefix(snap, req)
    # A hit saves best_len blocks of compute; do not queue behind more than a few
    # times that much extra work.
    extra = live[best].outstanding_tokens - live[fallback].outstanding_tokens
    saved = best_len * req.block_size
    return (best if extra <= 4 * saved else fallback), _decode_by_prefix(snap, req)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix_affinity": prefix_affinity,
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None


class PrefixIndex:
    """Bounded LRU map: prompt block hash -> prefill worker that last computed it.
    Owned by the router; snapshots hand policies a read-only view."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def record(self, block_hashes: Sequence[int], worker_id: str) -> None:
        for h in block_hashes:
            self._owner[h] = worker_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        for h in [h for h, w in self._owner.items() if w == worker_id]:
            del self._owner[h]

    def view(self) -> dict[int, str]:
        return self._owner
