"""A tensor-parallel follower rank's KV channel, carried over a pipe: ``RankChannel``
is what rank 0 (``sharded.py``) drives, ``serve_rank`` runs the rank's real channel
in the follower's process and answers. Calls are ``(call id, op, args)``; answers
``("ok" | "error", call id, value)``, events ``("events", None, events)``."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .factory import make_receiver, make_sender
from .layout import KVLayout

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a follower's answer to connect / expect / endpoint


class RankChannel:
    """A follower rank's channel as rank 0 sees it: the calls of a ``KVSender`` /
    ``KVReceiver``, carried over a pipe to ``serve_rank``. ``send``/``abort`` return at
    once; ``connect``/``expect``/``endpoint`` wait for the answer. Events come back on
    their own and are handed out by ``poll``."""

    def __init__(self, conn: Any, rank: int) -> None:
        self.rank = rank
        self._conn = conn
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, Future[Any]] = {}
        self._events: list[Any] = []
        self.dead: str | None = None  # why the rank's pipe is gone
        self._reader = threading.Thread(target=self._read, name=f"kv-rank{rank}", daemon=True)
        self._reader.start()

    def open(self, role: str, backend: str, options: dict[str, Any]) -> None:
        self._call("open", role, backend, options)

    def endpoint(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("endpoint")
        return result

    def dial(self, endpoint: dict[str, Any]) -> str:
        """The follower's whole connect (the caller waits; the follower dials off its
        channel's thread); its peer id."""
        return str(self._call("connect", endpoint))

    def attach(self, peer_id: str) -> str:
        return peer_id

    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> None:
        self._call("expect", request_id, list(dst_block_ids), timeout_s)

    def send(self, peer_id: str, request_id: str, src: Sequence[int], dst: Sequence[int],
             layers: tuple[int, int] | None = None, notify: dict[str, Any] | None = None,
             ) -> None:
        self._post("send", peer_id, request_id, list(src), list(dst), layers, notify)

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def poll(self) -> list[Any]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        if self.dead is None:
            try:
                self._call("close")
            except Exception as exc:  # the rank is going away anyway
                log.debug("rank %d channel close: %s", self.rank, exc)

    def _post(self, op: str, *args: Any) -> None:
        """Fire and forget; into a pipe that is already gone it marks the rank dead
        (what it carried then fails PEER_DIED, as when the reader sees the EOF)."""
        with self._lock:
            if self.dead is None:
                self._send_locked((None, op, args))

    def _call(self, op: str, *args: Any) -> Any:
        fut: Future[Any] = Future()
        with self._lock:
            if self.dead is None:
                call_id = next(self._ids)
                self._waiting[call_id] = fut
                self._send_locked((call_id, op, args))
                if self.dead is not None:  # the send found the pipe gone
                    del self._waiting[call_id]
            if self.dead is not None:
                raise ConnectionError(f"tensor-parallel rank {self.rank}: {self.dead}")
        return fut.result(CALL_TIMEOUT_S)

    def _send_locked(self, message: Any) -> None:
        """Send with ``_lock`` held; a closed pipe (the follower died, its reader may
        not have seen the EOF yet) marks the rank dead instead of raising."""
        try:
            self._conn.send(message)
        except OSError as exc:
            self.dead = f"channel gone ({type(exc).__name__})"

    def _read(self) -> None:
        while True:
            try:
                kind, call_id, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                with self._lock:
                    self.dead = f"channel gone ({type(exc).__name__})"
                    waiting, self._waiting = self._waiting, {}
                for fut in waiting.values():
                    fut.set_exception(ConnectionError(f"tensor-parallel rank {self.rank} "
                                                      "is gone"))
                return
            if kind == "events":
                with self._lock:
                    self._events.extend(value)
                continue
            with self._lock:
                fut = self._waiting.pop(call_id)
            if kind == "ok":
                fut.set_result(value)
            else:
                fut.set_exception(value)


def serve_rank(conn: Any, kv: torch.Tensor, layout: KVLayout, name: str) -> None:
    """A follower rank's side of ``RankChannel`` (on a thread of its own, until the
    pipe closes): opens the rank's channel over ``kv`` when asked, runs it on a
    ``ChannelThread`` and sends its events back."""
    from .driver import ChannelThread

    lock = threading.Lock()
    thread: ChannelThread[Any] | None = None
    if kv.is_cuda:
        torch.cuda.set_device(kv.device)

    def tell(msg: tuple[str, int | None, Any]) -> None:
        with lock, contextlib.suppress(OSError, ValueError):  # the leader is gone
            conn.send(msg)

    def answer(call_id: int | None, fut: Future[Any]) -> None:
        if call_id is not None:
            exc = fut.exception()
            tell(("ok", call_id, fut.result()) if exc is None else ("error", call_id, exc))

    while True:
        try:
            call_id, op, args = conn.recv()
        except (EOFError, OSError):
            break
        done: Future[Any] = Future()
        try:
            if op == "open":
                role, backend, options = args
                make = make_sender if role == "send" else make_receiver
                thread = ChannelThread(make(backend, kv, layout, **options),
                                       lambda evs, _when: tell(("events", None, evs)),
                                       f"kv-{role}-{name}")
                if kv.is_cuda:  # a new thread's current GPU is 0, not this rank's
                    thread.call(functools.partial(torch.cuda.set_device, kv.device)).result()
                done.set_result(None)
            elif thread is None:
                raise RuntimeError(f"{op} before the rank's channel was opened")
            elif op == "expect":  # thread-safe in every backend; then poll soon
                thread.channel.expect(*args)
                thread.wake()
                done.set_result(None)
            elif op == "connect":  # the handshake may wait on a stalled peer: not there
                done = thread.connect(args[0])
            elif op == "close":
                thread.close()
                thread = None
                done.set_result(None)
            else:
                fn = getattr(thread.channel, op)
                done = thread.call(functools.partial(fn, *args))
        except Exception as exc:
            done = Future()
            done.set_exception(exc)
        done.add_done_callback(functools.partial(answer, call_id))
    if thread is not None:
        thread.close()
