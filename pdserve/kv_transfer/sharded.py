"""KV transfer for tensor-parallel workers: every rank sends or receives its own KV heads.

A worker of N ranks (``engine/tp/``) has N channels, one per rank, each over that
rank's KV cache (a ``KVLayout`` with ``heads``) and each in that rank's process. Rank 0
holds the worker's one ``KVSender`` / ``KVReceiver``: a ``ShardedSender`` or
``ShardedReceiver`` here, which drives its own channel directly and the other ranks'
through a ``RankChannel`` (``rank_channel.py``: a pipe to ``serve_rank`` in each
follower process).

Head mapping (``plan_pairs``): for every decode rank j and every KV head it holds, the
first prefill rank holding that head sends it. Runs of heads from one prefill rank make
one pair (i -> j) carrying a ``Slice``; a decode rank fed by k prefill ranks expects its
request in k parts. P(TP=2) -> D(TP=1), 4 KV heads::

    P rank 0: heads [0, 2) ──slice [0, 2), part 0 of 2──┐
    P rank 1: heads [2, 4) ──slice [2, 4), part 1 of 2──┴─▶ D rank 0: heads [0, 4)

and P(TP=1) -> D(TP=2) is one prefill rank feeding two receivers, one part each. Every
backend moves the slice its own way (nixl: one region per block, layer and K/V unless
the two ranks hold the same heads; two-sided backends: gather, send, scatter).

Request ids: a decode worker of one rank expects ``rid`` itself (its endpoint is that
rank's own, so a plain sender can talk to it); rank j of a wider one expects
``rid@j``. A request ends on the worker side when every pair (sender) or every rank
(receiver) has ended: ok if all did, else failed with the first failure, after the
rest were aborted (so no rank still writes into the blocks).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import FailReason, KVReceiver, KVSender, RecvEvent, SendEvent
from .factory import make_receiver, make_sender
from .layout import KVLayout, KVLayoutMismatch, Slice
from .rank_channel import RankChannel
from .send_state import MAX_TOMBSTONES

log = logging.getLogger(__name__)

# Backends a follower rank can run: its process is neither the leader's (local) nor a
# Ray worker (ray).
PER_RANK_BACKENDS = ("nixl", "torch")


def plan_pairs(senders: Sequence[tuple[int, int]], receivers: Sequence[tuple[int, int]],
               ) -> list[tuple[int, int, Slice]]:
    """(sender rank, receiver rank, slice) for every pair that moves KV heads, from each
    side's heads per rank. ``KVLayoutMismatch`` naming both sides if a receiver rank
    holds a head no sender rank has."""
    pairs = []
    for j, (lo, hi) in enumerate(receivers):
        runs: list[list[int]] = []  # [sender rank, lo, hi)
        for h in range(lo, hi):
            i = next((i for i, (a, b) in enumerate(senders) if a <= h < b), None)
            if i is None:
                raise KVLayoutMismatch(
                    f"KV head {h} of receiver rank {j} is on no sender rank: sender ranks "
                    f"hold {[list(s) for s in senders]}, receiver ranks {[list(r) for r in receivers]}")
            if runs and runs[-1][0] == i and runs[-1][2] == h:
                runs[-1][2] = h + 1
            else:
                runs.append([i, h, h + 1])
        pairs += [(i, j, Slice((a, b), k, len(runs))) for k, (i, a, b) in enumerate(runs)]
    return pairs


def wire_id(request_id: str, rank: int, ranks: int) -> str:
    """The id receiver rank ``rank`` of ``ranks`` knows a request by."""
    return request_id if ranks == 1 else f"{request_id}@{rank}"


# ------------------------------------------------------------------ the worker side
Part = tuple[int, str]  # (rank, the id that rank's channel knows the request by)


@dataclass
class _Pending:
    left: set[Part]  # the parts not ended yet
    keys: list[Part]  # every part, as first registered
    failure: tuple[FailReason, str] | None = None
    notify: dict[str, Any] | None = None


class Fanout:
    """What both roles share: the ranks' channels, and each request in flight as parts
    -- one per (rank, pair) on a sender, one per rank on a receiver (``with_draft.py``
    fans out the same way over a target's channel and its draft's)."""

    aborted = ""  # the failure an abort() on this side reports

    def __init__(self, ranks: list[Any], layout: KVLayout, heads: list[tuple[int, int]]) -> None:
        self.layout = layout.model_wide()
        self._ranks = ranks  # rank 0: the channel itself; others: RankChannel
        self._heads = heads
        self._lock = threading.RLock()
        self._pending: dict[str, _Pending] = {}
        self._sub: dict[Part, str] = {}  # part -> request id
        self._events: list[Any] = []

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _register(self, rid: str, keys: list[Part]) -> _Pending:
        p = self._pending[rid] = _Pending(set(keys), keys)
        self._sub.update(dict.fromkeys(keys, rid))
        return p

    def _forget(self, rid: str) -> _Pending:
        p = self._pending.pop(rid)
        for key in p.keys:
            self._sub.pop(key, None)
        return p

    def poll(self) -> list[Any]:
        """Every rank's events folded into the requests' own; a rank that is gone fails
        its parts (PEER_DIED)."""
        got = [((r, ev.request_id), ev) for r, ch in enumerate(self._ranks) for ev in ch.poll()]
        dead = [(r, ch.dead) for r, ch in enumerate(self._ranks)
                if getattr(ch, "dead", None) is not None]
        with self._lock:
            for part, ev in got:
                self._part_ended(part, ev.ok, ev.reason, ev.error, getattr(ev, "notify", None))
            for r, why in dead:
                for part in [k for k in self._sub if k[0] == r]:
                    self._part_ended(part, False, FailReason.PEER_DIED,
                                     f"tensor-parallel rank {r}: {why}", None)
            out, self._events = self._events, []
            return out

    def _part_ended(self, part: Part, ok: bool, reason: FailReason | None, error: str,
                    notify: dict[str, Any] | None) -> None:
        rid = self._sub.get(part)
        p = None if rid is None else self._pending.get(rid)
        if rid is None or p is None or part not in p.left:
            return
        p.left.discard(part)
        if ok:
            p.notify = p.notify or notify
        elif p.failure is None:
            p.failure = (reason or FailReason.TRANSPORT, error)
            for other in p.left:  # stop the rest: no rank may still be writing
                self._abort_part(other)
        if not p.left:
            self._forget(rid)
            self._events.append(self._ended(rid, p))

    def _abort_part(self, part: Part) -> None:
        self._ranks[part[0]].abort(part[1])

    def abort(self, request_id: str) -> None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                return
            if p.failure is None:
                p.failure = (FailReason.ABORTED, self.aborted)
            parts = list(p.left)
        for part in parts:
            self._abort_part(part)

    def _ended(self, rid: str, p: _Pending) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Close every rank's channel; what is pending fails CLOSED."""
        for ch in self._ranks:
            try:
                ch.close()
            except Exception as exc:
                log.warning("closing a tensor-parallel rank's channel: %s", exc)
        with self._lock:
            for rid in list(self._pending):
                p = self._forget(rid)
                p.failure = (FailReason.CLOSED, "channel closed")
                self._events.append(self._ended(rid, p))


class FanoutSender(Fanout, KVSender):
    """What the fan-out senders share: a request is registered with its parts on its
    first send; once it ended, later sends for it are dropped, as for any sender."""

    aborted = "aborted by sender"

    def __init__(self, ranks: list[Any], layout: KVLayout, heads: list[tuple[int, int]]) -> None:
        super().__init__(ranks, layout, heads)
        self._over: OrderedDict[str, None] = OrderedDict()  # ended ids (later sends: dropped)

    def _pending_for(self, request_id: str, parts: list[Part]) -> tuple[_Pending | None, bool]:
        """Under the lock: the request's entry, registered with ``parts`` if new, and
        whether it is new; None: it ended (or failed) already, so the send is dropped."""
        p = self._pending.get(request_id)
        new = p is None
        if p is None:
            if request_id in self._over:
                return None, False
            p = self._register(request_id, parts)
        return (None if p.failure is not None else p), new

    def _ended(self, rid: str, p: _Pending) -> SendEvent:
        self._over[rid] = None
        while len(self._over) > MAX_TOMBSTONES:
            self._over.popitem(last=False)
        if p.failure is None:
            return SendEvent(rid, True)
        return SendEvent(rid, False, p.failure[0], p.failure[1])


class ShardedSender(FanoutSender):
    """Prefill role of a TP worker (or any worker talking to a TP decode worker)."""

    def __init__(self, ranks: list[Any], layout: KVLayout, heads: list[tuple[int, int]]) -> None:
        super().__init__(ranks, layout, heads)
        self._peers: dict[str, list[tuple[int, str, str]]] = {}  # -> (rank, sub peer, suffix)
        self._peer_ids = itertools.count()

    def connect(self, endpoint: dict[str, Any]) -> str:
        return self.attach(self.dial(endpoint))

    def dial(self, endpoint: dict[str, Any]) -> list[tuple[int, Any, str]]:
        """Every pair's handshake (a follower rank's whole connect: it dials off its
        own channel's thread too)."""
        ranks = endpoint.get("ranks") or [endpoint]
        self.layout.check_compatible(KVLayout.from_dict(endpoint["layout"]))
        theirs = [KVLayout.from_dict(ep["layout"]).head_range for ep in ranks]
        return [(i, self._ranks[i].dial({**ranks[j], "slice": cut.to_dict()}),
                 wire_id("", j, len(ranks)))
                for i, j, cut in plan_pairs(self._heads, theirs)]

    def attach(self, dialed: list[tuple[int, Any, str]]) -> str:
        subs = [(i, self._ranks[i].attach(d), suffix) for i, d, suffix in dialed]
        peer_id = f"tp-{next(self._peer_ids)}"
        self._peers[peer_id] = subs
        return peer_id

    def send(self, peer_id: str, request_id: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], layers: tuple[int, int] | None = None,
             notify: dict[str, Any] | None = None) -> None:
        subs = self._peers[peer_id]
        with self._lock:
            p, new = self._pending_for(request_id,
                                       [(i, request_id + suffix) for i, _, suffix in subs])
            if p is None:
                return
        # The first pair is rank 0's own channel (it holds head 0, which receiver rank 0
        # holds first): a bad call raises there, before anything is sent anywhere.
        for n, (i, sub, suffix) in enumerate(subs):
            try:
                self._ranks[i].send(sub, request_id + suffix, src_block_ids, dst_block_ids,
                                    layers, notify)
            except ValueError:
                if n == 0 and new:  # as if never called
                    with self._lock:
                        self._forget(request_id)
                raise


class FanoutReceiver(Fanout, KVReceiver):
    """What the fan-out receivers share: a request is ready when every part landed."""

    aborted = "aborted by receiver"

    def _ended(self, rid: str, p: _Pending) -> RecvEvent:
        if p.failure is None:
            return RecvEvent(rid, True, notify=p.notify or {})
        return RecvEvent(rid, False, reason=p.failure[0], error=p.failure[1])


class ShardedReceiver(FanoutReceiver):
    """Decode role of a TP worker: a request is ready when every rank has its heads."""

    def endpoint(self) -> dict[str, Any]:
        eps = [ch.endpoint() for ch in self._ranks]
        if len(eps) == 1:
            return eps[0]
        return {"backend": eps[0]["backend"], "layout": self.layout.to_dict(),
                "num_blocks": eps[0]["num_blocks"], "ranks": eps}

    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> None:
        n = len(self._ranks)
        keys = [(j, wire_id(request_id, j, n)) for j in range(n)]
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request {request_id!r} is already expected")
            self._ranks[0].expect(keys[0][1], dst_block_ids, timeout_s)
            p = self._register(request_id, keys)
        for j, wire in keys[1:]:
            try:
                self._ranks[j].expect(wire, dst_block_ids, timeout_s)
            except Exception as exc:  # the ranks' block states differ: never write here
                with self._lock:  # the ranks that expect it end it (failed), the rest never
                    p.left = set(keys[:j])
                    p.failure = (FailReason.ABORTED, f"rank {j} refused the blocks")
                self.abort(request_id)
                raise ValueError(f"tensor-parallel rank {j} refused blocks for "
                                 f"{request_id!r}: {exc}") from exc


def open_channel(role: str, backend: str, kv: torch.Tensor, layout: KVLayout,
                 heads: list[tuple[int, int]], links: list[Any],
                 options: dict[str, Any] | None = None) -> KVSender | KVReceiver:
    """The worker's channel for ``role`` ("send" | "recv"): rank 0's own over ``kv``
    (its ``layout``) plus, on a TP worker, each follower's over ``links`` (pipes to
    ``serve_rank``); ``heads``: every rank's KV heads."""
    options = options or {}
    if links and backend not in PER_RANK_BACKENDS:
        raise ValueError(f"a tensor-parallel worker moves KV from every rank, which the "
                         f"{backend!r} transfer backend cannot (its ranks are processes of "
                         f"their own): use one of {', '.join(PER_RANK_BACKENDS)}")
    make = make_sender if role == "send" else make_receiver
    ranks: list[Any] = [make(backend, kv, layout, **options)]
    try:
        for r, conn in enumerate(links, start=1):
            ch = RankChannel(conn, r)
            ranks.append(ch)
            ch.open(role, backend, options)
    except BaseException:
        for ch in ranks:
            ch.close()
        raise
    cls = ShardedSender if role == "send" else ShardedReceiver
    return cls(ranks, layout, heads)
