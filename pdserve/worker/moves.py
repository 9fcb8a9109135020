"""Moving a running request between decode workers (live KV migration): the decode
worker's half. The router drives a move (``router/migration.py``); here are its two
ends.

The target B (``Moving``, a mixin of ``DecodeWorker``), ``reserve_moved``: while the
request keeps decoding on A, a reservation of its tokens so far as the router has them
(a retry's prompt and parameters), plus ``spare`` blocks for the tokens A makes until
it stops. The receiver expects two transfers into it: the *head* (the full blocks so
far, ``<id>/head``) and the *tail* (the rest, with the tokens A made meanwhile). When
both landed, ``engine.start_moved`` appends those tokens as resumed output (grammar,
seeded draws, budgets go on after them) and the next step computes the last token's
KV and samples the next token. Nothing is prefilled again.

The source A (``Mover``, opened at A's first move: a KV sender over A's own cache on a
channel thread of its own, connected like a prefill worker's, ``move_connect``):

* ``move_blocks`` sends the head -- full blocks never change, so A decodes on -- and
  answers once it is sent;
* ``move_stop``, at A's next step boundary: the request leaves A's engine at its
  length L then (its blocks pinned for the send), the tail goes out, and the answer
  is L at once: the router hands the stream over once it has read A's tokens up to
  L. A failed tail fails the request on B (retried from the tokens the client has).

Block ownership on B: a moved request's blocks go back only once both transfers are
reported (landed, failed or aborted), as for any reservation (decode.py).

A worker with a draft model or tensor-parallel ranks does not move requests yet:
``reserve_moved`` answers ``None`` and the router leaves the request where it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import AttemptFailed, FailReason
from pdserve.kv_transfer import KVSender, RecvEvent, SendEvent
from pdserve.kv_transfer.driver import ChannelThread
from pdserve.kv_transfer.recv_state import COVERS
from pdserve.messages import RequestDelta, Reservation
from pdserve.tracing import Carrier

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.kv_transfer import KVReceiver
    from pdserve.output_stream import OutputServer
    from pdserve.thread_loop import ThreadLoop
    from pdserve.tracing import Marks

log = logging.getLogger("pdserve.decode_worker")


class Mover:
    """A decode worker's sends of moved requests' KV (its own cache's blocks)."""

    def __init__(self, sender: KVSender, engine: LLMEngine, loop: ThreadLoop,
                 name: str) -> None:
        self.sender = sender
        self.engine = engine
        self._loop = loop
        self.transfer = ChannelThread(sender, self._on_events, name)
        self._peers: dict[str, tuple[str, dict[str, Any]]] = {}  # worker id -> (peer, endpoint)
        self._sends: dict[str, tuple[Future[int], list[int], str]] = {}  # send id -> ...

    async def connect(self, worker_id: str, endpoint: dict[str, Any]) -> None:
        known = self._peers.get(worker_id)
        if known is not None and known[1] == endpoint:
            return
        peer = await asyncio.wrap_future(self.transfer.connect(endpoint))
        self._peers[worker_id] = (peer, endpoint)

    def send(self, send_id: str, worker_id: str, src: list[int], dst: list[int],
             notify: dict[str, Any] | None = None) -> Future[int]:
        """On the loop thread: pin ``src`` and send it into ``worker_id``'s ``dst`` (one
        final transfer, ``notify`` with it); resolves to the bytes sent once the
        sender no longer reads them."""
        known = self._peers.get(worker_id)
        if known is None:
            raise AttemptFailed(FailReason.NOT_CONNECTED, f"no channel to {worker_id!r}")
        done: Future[int] = Future()
        done.set_running_or_notify_cancel()
        self.engine.pin(src)
        self._sends[send_id] = (done, src, worker_id)
        peer = known[0]
        self.transfer.post(lambda: self.sender.send(peer, send_id, src, dst, layers=None,
                                                    notify=notify or {"moved": True}))
        return done

    def _on_events(self, events: list[SendEvent], when: float) -> None:
        self._loop.post(lambda: self._sent(events))  # channel thread -> loop thread

    def _sent(self, events: list[SendEvent]) -> None:
        for ev in events:
            entry = self._sends.pop(ev.request_id, None)
            if entry is None:
                continue
            done, pinned, worker_id = entry
            self.engine.unpin(pinned)
            if ev.ok:
                done.set_result(len(pinned) * self.engine.kv_layout().block_bytes)
                continue
            if ev.reason is FailReason.PEER_DIED:  # reconnect at the next move
                self._peers.pop(worker_id, None)
            done.set_exception(AttemptFailed(ev.reason or FailReason.TRANSPORT,
                                             f"moving KV to {worker_id} failed: {ev.error}"))

    def close(self) -> None:
        self.transfer.close()


@dataclass
class _Incoming:
    """A moved request's transfers on the target."""

    head: str | None  # the head's expectation id, while it is not reported
    head_ok: bool = True
    tail: RecvEvent | None = None  # the tail's report, held while the head's is to come


def head_id(request_id: str) -> str:
    return f"{request_id}/head"


class Moving:
    """``DecodeWorker``'s moves, both ends (module doc)."""

    if TYPE_CHECKING:  # the worker's, used here
        engine: LLMEngine
        receiver: KVReceiver
        transfer: ChannelThread[KVReceiver]
        outputs: OutputServer
        loop: ThreadLoop
        marks: dict[str, Marks]
        kv_timeout_s: float
        worker_id: str
        _expecting: set[str]
        _aborted: set[str]

        async def _on_loop(self, fn: Callable[[], Any]) -> Any: ...
        def _open_channel(self, role: str, transfer: str,
                          options: dict[str, Any] | None) -> Any: ...
        def _traced(self, request_id: str, carrier: Carrier | None) -> None: ...

    _mover: Mover | None = None
    _opening: asyncio.Future[None] | None = None  # the mover being opened

    def _init_moves(self, transfer: str, options: dict[str, Any] | None) -> None:
        self._transfer_kind = (transfer, options)
        self._incoming: dict[str, _Incoming] = {}  # moved here, not started yet
        self._heads: dict[str, str] = {}  # head expectation id -> its request

    def can_move(self) -> bool:
        return self.engine.draft is None and self.engine.config.tensor_parallel_size == 1

    # ------------------------------------------------------------ async API
    async def move_connect(self, worker_id: str, endpoint: dict[str, Any]) -> None:
        """Source: open (once) the channel to decode worker ``worker_id``'s receiver."""
        if self._mover is None:
            if self._opening is None or self._opening.done():
                self._opening = asyncio.ensure_future(self._open_mover())
            await asyncio.shield(self._opening)
        assert self._mover is not None
        await self._mover.connect(worker_id, endpoint)

    async def _open_mover(self) -> None:
        transfer, options = self._transfer_kind
        # Off the loop: a backend's start-up (nixl's agent, its memory registration)
        # takes a second, and every request here would wait that long for a token.
        sender = await asyncio.to_thread(self._open_channel, "send", transfer, options)
        self._mover = Mover(sender, self.engine, self.loop, f"kv-move-{self.worker_id}")

    async def reserve_moved(self, request_id: str, token_ids: Sequence[int],
                            params: SamplingParams, head_blocks: int, spare_blocks: int,
                            router_id: str = "", trace: Carrier | None = None,
                            ) -> Reservation | None:
        """Target: the moved request's blocks (module doc): its first ``reused`` from
        this worker's prefix cache, the head up to block ``head_blocks``, the rest the
        tail's. ``None`` when there is no room or no moves here."""
        return await self._on_loop(lambda: self._reserve_moved(
            request_id, token_ids, params, head_blocks, spare_blocks, router_id, trace))

    async def move_blocks(self, request_id: str, send_id: str, worker_id: str,
                          first_block: int, dst_blocks: Sequence[int]) -> int:
        """Source: send the request's computed blocks ``first_block..`` into
        ``worker_id``'s ``dst_blocks``; answers the bytes sent once sent.
        ``AttemptFailed``: the send failed, or (ABORTED) the request is not here."""
        fut = await self._on_loop(lambda: self._move_blocks(
            request_id, send_id, worker_id, first_block, list(dst_blocks)))
        return await asyncio.wrap_future(fut)

    async def move_stop(self, request_id: str, send_id: str, worker_id: str,
                        first_block: int, dst_blocks: Sequence[int],
                        known_tokens: int) -> tuple[int, int]:
        """Source: the request leaves this engine at its length L; its blocks from
        ``first_block`` holding KV go into ``dst_blocks`` with its tokens after the
        first ``known_tokens``. Answers (L, bytes) as the send starts. ABORTED: not
        here; ``ValueError``: its KV outgrew ``dst_blocks`` (it stays here)."""
        return await self._on_loop(lambda: self._move_stop(
            request_id, send_id, worker_id, first_block, list(dst_blocks), known_tokens))

    # ------------------------------------------------------------- loop side
    def _reserve_moved(self, rid: str, token_ids: Sequence[int], params: SamplingParams,
                       head: int, spare: int, router_id: str,
                       trace: Carrier | None) -> Reservation | None:
        if not self.can_move() or self.engine.reserve(rid, token_ids, params) is None:
            return None
        if not self.engine.reserve_more(rid, spare):
            self.engine.abort(rid)
            return None
        blocks = self.engine.block_ids(rid)
        reused = self.engine.cached_tokens(rid) // self.engine.block_size
        head = max(head, reused)
        hid = head_id(rid) if head > reused else None
        if hid is not None and not self._expect(hid, blocks[reused:head]):
            self.engine.abort(rid)
            return None
        if not self._expect(rid, blocks[head:]):
            if hid is not None:  # nothing was sent yet: no late write can land
                self._expecting.discard(hid)
                self.receiver.abort(hid)
            self.engine.abort(rid)
            return None
        if hid is not None:
            self._heads[hid] = rid
        self._incoming[rid] = _Incoming(hid)
        self.outputs.assign(rid, router_id)
        self._traced(rid, trace)
        return Reservation(blocks, reused)

    def _expect(self, rid: str, blocks: list[int]) -> bool:
        """The receiver expects KV for ``rid`` in ``blocks``."""
        try:
            self.receiver.expect(rid, blocks, self.kv_timeout_s)
        except ValueError as exc:  # blocks the receiver still expects KV in (decode.py)
            log.error("decode worker %s: move %s refused: %s", self.worker_id, rid, exc)
            return False
        self.transfer.wake()
        self._expecting.add(rid)
        return True

    def _running(self, rid: str) -> Mover:
        req = self.engine.requests.get(rid)
        if req is None or req.is_finished or self._mover is None:
            raise AttemptFailed(FailReason.ABORTED, f"request {rid} is not running here")
        return self._mover

    def _move_blocks(self, rid: str, send_id: str, worker_id: str, first: int,
                     dst: list[int]) -> Future[int]:
        mover = self._running(rid)
        computed = self.engine.computed_blocks(rid)
        if first + len(dst) > len(computed):
            raise ValueError(f"move of {rid}: blocks {first}..{first + len(dst)} of "
                             f"{len(computed)} computed")
        return mover.send(send_id, worker_id, computed[first:first + len(dst)], dst)

    def _move_stop(self, rid: str, send_id: str, worker_id: str, first: int,
                   dst: list[int], known: int) -> tuple[int, int]:
        mover = self._running(rid)
        req = self.engine.requests[rid]
        length, bs = req.num_tokens, self.engine.block_size
        need = -(-(length - 1) // bs)  # the blocks of every token but the last
        if need - first > len(dst):
            raise ValueError(f"move of {rid}: {length} tokens outgrew the target's "
                             f"{first + len(dst)} blocks")
        src = list(req.block_ids[first:need])
        # The send first: it pins the blocks, so the abort frees only the request's hold,
        # and a send that cannot start (no channel) leaves the request here, running.
        mover.send(send_id, worker_id, src, dst[:len(src)],
                   {"tokens": list(req.token_ids[known:]), COVERS: dst[:len(src)]})
        self.marks.pop(rid, None)
        self.outputs.release(rid)  # (its last tokens, published already, still go out)
        self.engine.abort(rid)
        return length, len(src) * self.engine.kv_layout().block_bytes

    def _moved_arrived(self, ev: RecvEvent, batch: list[RequestDelta]) -> bool:
        """A move's head or tail was reported; False: not a move's."""
        rid = ev.request_id
        owner = self._heads.pop(rid, None)
        if owner is not None:  # a head
            self._aborted.discard(rid)
            inc = self._incoming.get(owner)
            if inc is not None:
                inc.head, inc.head_ok = None, ev.ok
                if inc.tail is not None:  # the tail came first: settle it now
                    self._settle(owner, inc.tail, batch)
            return True
        inc = self._incoming.get(rid)
        if inc is None:
            return False
        if inc.head is not None:  # its blocks wait for the head's report
            inc.tail = ev
            return True
        self._settle(rid, ev, batch)
        return True

    def _settle(self, rid: str, ev: RecvEvent, batch: list[RequestDelta]) -> None:
        inc = self._incoming.pop(rid)
        if rid in self._aborted:  # nobody waits for it: its blocks can be reused now
            self._aborted.discard(rid)
            self.engine.abort(rid)
            return
        if not self.engine.has_request(rid):
            return
        error = "" if ev.ok and inc.head_ok else f"moved KV failed: {ev.error or 'head'}"
        if not error:
            try:
                self.engine.start_moved(rid, (ev.notify or {}).get("tokens", []))
                return
            except ValueError as exc:
                error = str(exc)
        self.engine.abort(rid)
        batch.append(RequestDelta(rid, [], finish_reason="error",
                                  failure=ev.reason or FailReason.TRANSPORT, error=error))

    def _abort_move(self, rid: str) -> bool:
        """An abort of a request moving here whose head is not reported: both
        expectations end, and its blocks wait for both reports. False: not such."""
        inc = self._incoming.get(rid)
        if inc is None or inc.head is None:
            return False
        for eid in (inc.head, rid):
            if eid in self._expecting and eid not in self._aborted:
                self.transfer.post(lambda eid=eid: self.receiver.abort(eid))  # type: ignore[misc]
            self._aborted.add(eid)
        return True

    def _close_moves(self) -> None:
        if self._mover is not None:
            self._mover.close()
