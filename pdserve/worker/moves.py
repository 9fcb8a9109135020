"""Moving a running request between decode workers (live KV migration): the decode
worker's half. The router drives a move (``router/migration.py``); here are the two
ends of it.

The source A (``Mover``, opened at A's first move): a KV sender over A's own cache on a
channel thread of its own, connected to the targets' receivers like a prefill worker's
(``move_connect``). ``move_out`` pins the request's blocks in a range and sends them into
the blocks the target reserved; with ``stop`` it first takes the request out of A's
engine (its blocks stay pinned until the send ends), so A makes no token of it after.

The target B (``Moving``, a mixin of ``DecodeWorker``):

1. ``stage``: while A keeps decoding, blocks for the request's full blocks so far,
   keyed by their prefix hashes -- shared where B's prefix cache holds them, the rest
   written by A's first send and then entered into B's prefix cache; held until
   ``unstage``.
2. ``reserve_moved``: once the router stops reading A's tokens, a reservation of the
   request's tokens so far (a retry's prompt: the original prompt plus every token the
   client got) -- the staged blocks are its prefix hits -- and the rest of the KV comes
   from A's second send (the tail). When it lands (or at once, when the hits hold it
   all) ``engine.start_moved``: the next step computes the last token's KV and samples
   the next token. Sampler, penalties and grammar state are rebuilt from those tokens
   as for a retry (``resumed_tokens``); nothing is prefilled again.

A worker with a draft model or tensor-parallel ranks does not move requests yet: its
``stage`` answers ``None`` and the router leaves the request where it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pdserve.engine.block_pool import prefix_block_hashes, root_hash
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import AttemptFailed, FailReason
from pdserve.kv_transfer import KVSender, RecvEvent, SendEvent
from pdserve.kv_transfer.driver import ChannelThread
from pdserve.messages import RequestDelta, Reservation, WorkerMetrics
from pdserve.tracing import Carrier

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.kv_transfer import KVReceiver
    from pdserve.output_stream import OutputServer
    from pdserve.thread_loop import ThreadLoop
    from pdserve.tracing import Marks

log = logging.getLogger("pdserve.decode_worker")
STAGE_KEEP_KV_TIMEOUTS = 2


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

    def send(self, send_id: str, worker_id: str, src: list[int], dst: list[int]) -> Future[int]:
        """On the loop thread: pin ``src`` and send it into ``worker_id``'s ``dst``;
        resolves to the bytes sent once the sender no longer reads them."""
        known = self._peers.get(worker_id)
        if known is None:
            raise AttemptFailed(FailReason.NOT_CONNECTED, f"no channel to {worker_id!r}")
        done: Future[int] = Future()
        done.set_running_or_notify_cancel()
        if not src:
            done.set_result(0)
            return done
        self.engine.pin(src)
        self._sends[send_id] = (done, src, worker_id)
        peer = known[0]
        self.transfer.post(lambda: self.sender.send(peer, send_id, src, dst, layers=None,
                                                    notify={"moved": True}))
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
        _kv_arrived: dict[str, float]
        _received: dict[str, float]

        async def _on_loop(self, fn: Callable[[], Any]) -> Any: ...
        def _open_channel(self, role: str, transfer: str,
                          options: dict[str, Any] | None) -> Any: ...
        def _traced(self, request_id: str, carrier: Carrier | None) -> None: ...

    _mover: Mover | None = None
    _transfer_kind: tuple[str, dict[str, Any] | None] = ("local", None)

    def _init_moves(self, transfer: str, options: dict[str, Any] | None) -> None:
        self._transfer_kind = (transfer, options)
        # stage id -> its blocks, their hashes, how many were shared, when staged
        self._staged: dict[str, tuple[list[int], list[int], int, float]] = {}
        self._moved: set[str] = set()  # reserved moves whose tail KV is to land

    def can_move(self) -> bool:
        return self.engine.draft is None and self.engine.config.tensor_parallel_size == 1

    # ------------------------------------------------------------ async API
    async def move_connect(self, worker_id: str, endpoint: dict[str, Any]) -> None:
        """Source: open (once) the channel to decode worker ``worker_id``'s receiver."""
        if self._mover is None:
            transfer, options = self._transfer_kind
            sender = await self._on_loop(lambda: self._open_channel("send", transfer, options))
            if self._mover is None:
                self._mover = Mover(sender, self.engine, self.loop, f"kv-move-{self.worker_id}")
            else:
                sender.close()
        await self._mover.connect(worker_id, endpoint)

    async def stage(self, stage_id: str, token_ids: Sequence[int],
                    cache_salt: str | None) -> Reservation | None:
        """Target: blocks for the full blocks of ``token_ids`` (module doc, 1); the
        first ``reused`` are shared and get nothing. ``None``: no room, or no moves
        here."""
        return await self._on_loop(lambda: self._stage(stage_id, token_ids, cache_salt))

    async def unstage(self, stage_id: str) -> None:
        """Target: drop a stage's hold on its blocks (idempotent)."""
        await self._on_loop(lambda: self._unstage(stage_id))

    async def reserve_moved(self, request_id: str, token_ids: Sequence[int],
                            params: SamplingParams, router_id: str = "",
                            trace: Carrier | None = None) -> Reservation | None:
        """Target: the moved request's blocks (module doc, 2); the tail is sent into
        ``blocks[reused:]``. ``None`` when there is no room."""
        return await self._on_loop(lambda: self._reserve_moved(
            request_id, token_ids, params, router_id, trace))

    async def move_out(self, request_id: str, send_id: str, worker_id: str,
                       first_block: int, dst_blocks: Sequence[int], stop: bool) -> int:
        """Source: send the request's blocks ``first_block..`` into ``worker_id``'s
        ``dst_blocks``; with ``stop``, the request leaves this engine first. Answers
        the bytes sent once sent; ``AttemptFailed`` when the send failed, or (ABORTED)
        when the request is not running here."""
        fut = await self._on_loop(lambda: self._move_out(
            request_id, send_id, worker_id, first_block, list(dst_blocks), stop))
        return await asyncio.wrap_future(fut)

    # ------------------------------------------------------------- loop side
    def _stage(self, stage_id: str, token_ids: Sequence[int],
               cache_salt: str | None) -> Reservation | None:
        if not self.can_move() or stage_id in self._staged:
            return None
        hashes = prefix_block_hashes(token_ids, self.engine.block_size,
                                     root=root_hash(cache_salt))
        got = self.engine.stage(hashes)
        if got is None:
            return None
        blocks, shared = got
        if not self._expect(stage_id, blocks[shared:]):
            self.engine.unpin(blocks)
            return None
        self._staged[stage_id] = (blocks, hashes, shared, time.monotonic())
        return Reservation(blocks, shared)

    def _unstage(self, stage_id: str) -> None:
        entry = self._staged.get(stage_id)
        if entry is None:
            return
        if stage_id in self._expecting:  # KV may still land: free on the report
            self._drop(stage_id)
            return
        del self._staged[stage_id]
        self.engine.unpin(entry[0])

    def _reserve_moved(self, rid: str, token_ids: Sequence[int], params: SamplingParams,
                       router_id: str, trace: Carrier | None) -> Reservation | None:
        if not self.can_move():
            return None
        blocks = self.engine.reserve(rid, token_ids, params)
        if blocks is None:
            return None
        bs = self.engine.block_size
        need = -(-(len(token_ids) - 1) // bs)  # the blocks of every token but the last
        reused = self.engine.cached_tokens(rid) // bs
        if not self._expect(rid, blocks[reused:need]):
            self.engine.abort(rid)
            return None
        self.outputs.assign(rid, router_id)
        self._traced(rid, trace)
        if reused >= need:  # the staged blocks hold it all
            self.engine.start_moved(rid)
        else:
            self._moved.add(rid)
        return Reservation(blocks[:need], reused)

    def _expect(self, rid: str, blocks: list[int]) -> bool:
        """The receiver expects KV for ``rid`` in ``blocks`` (none: nothing to do)."""
        if not blocks:
            return True
        try:
            self.receiver.expect(rid, blocks, self.kv_timeout_s)
        except ValueError as exc:  # blocks the receiver still expects KV in (decode.py)
            log.error("decode worker %s: move %s refused: %s", self.worker_id, rid, exc)
            return False
        self.transfer.wake()
        self._expecting.add(rid)
        return True

    def _move_out(self, rid: str, send_id: str, worker_id: str, first: int,
                  dst: list[int], stop: bool) -> Future[int]:
        req = self.engine.requests.get(rid)
        if req is None or req.is_finished or self._mover is None:
            raise AttemptFailed(FailReason.ABORTED, f"request {rid} is not running here")
        computed = self.engine.computed_blocks(rid)
        src = list(req.block_ids[first:first + len(dst)])
        last_full = first + len(dst) <= len(computed)
        if len(src) < len(dst) or not (last_full or stop):
            raise ValueError(f"move of {rid}: blocks {first}..{first + len(dst)} of "
                             f"{len(req.block_ids)} ({len(computed)} computed)")
        if stop:  # pinned first: the abort frees the request's hold, not the send's
            self.engine.pin(src)
            self._drop(rid)
            try:
                return self._mover.send(send_id, worker_id, src, dst)
            finally:
                self.engine.unpin(src)
        return self._mover.send(send_id, worker_id, src, dst)

    def _moved_arrived(self, ev: RecvEvent, batch: list[RequestDelta]) -> bool:
        """A stage's or a moved request's KV landed (or failed); False: not a move's."""
        rid = ev.request_id
        if rid in self._staged:
            blocks, hashes, shared, _ = self._staged[rid]
            if rid in self._aborted:  # unstaged while in flight
                self._aborted.discard(rid)
                del self._staged[rid]
                self.engine.unpin(blocks)
            elif ev.ok:
                self.engine.register(blocks[shared:], hashes[shared:])
            return True
        if rid not in self._moved:
            return False
        self._moved.discard(rid)
        if rid in self._aborted or not self.engine.has_request(rid):
            return False  # decode.py's rules: free it
        if not ev.ok:
            self.engine.abort(rid)
            batch.append(RequestDelta(rid, [], finish_reason="error",
                                      failure=ev.reason or FailReason.TRANSPORT,
                                      error=f"moved KV failed: {ev.error}"))
            return True
        self.engine.start_moved(rid)
        return True

    def _before_publish(self, m: WorkerMetrics) -> None:
        """(The loop's periodic hook.) A stage its router never claimed nor dropped
        -- the router died, or lost this worker for a while -- is dropped after
        ``STAGE_KEEP_KV_TIMEOUTS`` transfer timeouts: a move's first phase ends within
        one, and its second follows at once."""
        now = time.monotonic()
        keep = STAGE_KEEP_KV_TIMEOUTS * self.kv_timeout_s
        for stage_id in [k for k, v in self._staged.items()
                         if now - v[3] > keep and k not in self._aborted]:
            log.warning("decode worker %s: stage %s unclaimed for %.0f s: dropped",
                        self.worker_id, stage_id, keep)
            self._unstage(stage_id)

    def _close_moves(self) -> None:
        if self._mover is not None:
            self._mover.close()

    if TYPE_CHECKING:
        def _drop(self, request_id: str) -> None: ...

