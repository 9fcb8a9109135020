"""Lockstep: a tensor-parallel leader broadcasts every state-changing engine call
(``@replicated``) before making it; a follower replays them (``follow``) and checks
that its own call ended as the leader's did."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.engine.tp.collectives import TPGroup

F = TypeVar("F", bound=Callable[..., Any])


# The names of the methods ``replicated`` marked: the only calls a follower replays.
REPLICATED: set[str] = set()


def replicated(fn: F) -> F:
    """An ``LLMEngine`` method that changes state: on a TP leader, broadcast the call to
    the followers first (once: calls it makes itself are not broadcast again)."""
    REPLICATED.add(fn.__name__)

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        tp: TPGroup | None = self.tp
        if tp is None or tp.rank != 0 or self._in_call:
            return fn(self, *args, **kwargs)
        tp.broadcast_object((fn.__name__, args, kwargs, tp.last_error))
        self._in_call = True
        try:
            result = fn(self, *args, **kwargs)
        except ValueError as exc:  # bad input: the followers must have refused it too
            tp.last_error = str(exc)
            raise
        finally:
            self._in_call = False
        tp.last_error = None
        return result

    return wrapper  # type: ignore[return-value]


STOP = "__stop__"


def close_link(link: Any) -> None:
    """Close the leader's end of a pipe to a follower (a ``multiprocessing``
    connection) so that the follower sees it end at once. ``close`` alone does not
    while a thread here is blocked reading it (the KV channel's reader holds the socket
    open): the follower would wait for its end-of-file. Shutting the socket down ends
    both sides' reads."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(link.fileno()))
        with sock:
            sock.shutdown(socket.SHUT_RDWR)
    link.close()


def follow(engine: Any) -> None:
    """A follower's life: replay the leader's calls until it says stop. Every message
    carries how the leader's previous call ended (the ``ValueError`` it raised, or
    None); a follower whose own call ended otherwise is out of step: ``RuntimeError``
    (its process ends, the worker restarts), as is a name that is not a replicated
    method. Bad input refused by every rank alike is no desync."""
    tp: TPGroup = engine.tp
    mine: str | None = None  # how this rank's previous call ended
    while True:
        name, args, kwargs, theirs = tp.broadcast_object()
        if theirs != mine:
            def ended(e: str | None) -> str:
                return "succeeded" if e is None else f"raised ValueError({e!r})"

            raise RuntimeError(f"tensor-parallel rank {tp.rank} is out of step with the "
                               f"leader: its last call {ended(mine)}, the leader's "
                               f"{ended(theirs)}")
        if name == STOP:
            return
        if name not in REPLICATED:
            raise RuntimeError(f"tensor-parallel leader sent {name!r}, which is not a "
                               f"replicated engine method ({', '.join(sorted(REPLICATED))})")
        try:
            getattr(engine, name)(*args, **kwargs)
            mine = None
        except ValueError as exc:
            mine = str(exc)
