"""One background thread per (sender, peer) for the two-sided backends, so send() never
blocks: it queues jobs, the thread gathers and transmits them in order; and
``ThreadedSender``, the sender half those backends (torch, ray) share around it.

The thread reports each data job's outcome on the tracker's completion queue and never
touches the tracker itself. When the peer is gone (a transmit raised) it records why in
`dead`, fails the queued jobs and every later one. When idle for `idle_s` it calls
`on_idle` (the torch backend sends a PING there, which is also how it notices a dead
peer between requests).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .base import FailReason, SendEvent
from .layout import KVLayout, Slice
from .send_state import Cancel, Numbered
from .sender_base import BaseSender, Outgoing
from .wire import Kind, Message

log = logging.getLogger(__name__)

Completion = tuple[str, tuple[FailReason, str] | None]


@dataclass(frozen=True)
class Job:
    msg: Message
    src: tuple[int, ...] = ()  # source block ids, in the same order as msg.dst
    cancel: Cancel | None = None  # None: a control message, no completion reported


class PeerWorker:
    def __init__(
        self,
        name: str,
        transmit: Callable[[Job], None],
        completions: queue.SimpleQueue[Completion],
        on_idle: Callable[[], None] | None = None,
        idle_s: float = 1.0,
    ) -> None:
        self._transmit = transmit
        self._completions = completions
        self._on_idle = on_idle
        self._idle_s = idle_s
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self.dead: str | None = None  # why the peer is unusable; set once, by the thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self, last: Job | None, timeout_s: float) -> None:
        """Send `last` (e.g. BYE) after everything queued, then end the thread."""
        if last is not None:
            self._jobs.put(last)
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                self._idle()
                continue
            if job is None:
                return
            self._one(job)

    def _one(self, job: Job) -> None:
        failure: tuple[FailReason, str] | None = None
        if self.dead is not None:
            failure = (FailReason.PEER_DIED, self.dead)
        elif job.cancel is not None and job.cancel.set:
            failure = (FailReason.ABORTED, "cancelled")
        else:
            try:
                self._transmit(job)
            except Exception as exc:  # the transport's errors are not typed
                self.dead = f"peer unreachable: {exc}"
                failure = (FailReason.PEER_DIED, self.dead)
                log.warning("KV send to peer failed: %s", exc)
        if job.cancel is not None:
            self._completions.put((job.msg.request_id, failure))

    def _idle(self) -> None:
        if self._on_idle is None or self.dead is not None:
            return
        try:
            self._on_idle()
        except Exception as exc:
            self.dead = f"peer unreachable: {exc}"


def describe(exc: BaseException) -> str:
    """Short one-line form of a transport exception for events."""
    text: Any = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


class ThreadedSender(BaseSender):
    """A ``BaseSender`` whose every peer has a ``PeerWorker`` thread (the two-sided
    backends, torch and ray): a dead thread fails its peer's requests at ``poll``,
    numbered messages and aborts are queued on the peer's thread, ``close`` sends each
    peer a BYE after what it has queued. A backend's ``connect`` builds the thread with
    its transmit function and hands it to ``_add_peer``."""

    bye_timeout_s = 5.0  # how long close() waits for a peer's thread to send its BYE

    def __init__(self, kv: torch.Tensor, layout: KVLayout, timeout_s: float) -> None:
        super().__init__(kv, layout, timeout_s)
        self._threads: dict[str, tuple[PeerWorker, int]] = {}  # peer -> (thread, its blocks)

    def _add_peer(self, peer_id: str, cut: Slice, worker: PeerWorker, num_blocks: int) -> str:
        self._threads[peer_id] = (worker, num_blocks)
        return self._bind(peer_id, cut)

    def poll(self) -> list[SendEvent]:
        for peer_id, (worker, _) in self._threads.items():
            if worker.dead is not None:
                self.state.fail_peer(peer_id, FailReason.PEER_DIED, worker.dead)
        return self.state.drain()

    def _peer_blocks(self, peer_id: str) -> int:
        return self._threads[peer_id][1]

    def _transmit(self, peer_id: str, jobs: list[Outgoing], numbered: Numbered) -> None:
        for msg, src in jobs:
            self._threads[peer_id][0].submit(Job(msg, tuple(src), numbered.cancel))

    def _tell_abort(self, peer_id: str, request_id: str) -> None:
        # tell D so it can release the blocks now
        self._threads[peer_id][0].submit(Job(Message(Kind.ABORT, request_id)))

    def _goodbye(self) -> None:
        for worker, _ in self._threads.values():
            worker.stop(Job(Message(Kind.BYE)), timeout_s=self.bye_timeout_s)
        self._threads.clear()
