"""The fault model's vocabulary: why a request's attempt failed (``FailReason``) and
the two errors that cross the router <-> worker boundary.

Rules (ARCHITECTURE.md, "Failure handling"):

* ``AttemptFailed``: one request's attempt failed on a worker (its KV transfer timed
  out, its peer aborted it, the worker was not connected to the chosen peer). The
  router retries the request elsewhere; the worker stays in routing.
* ``WorkerGone``: the worker itself is unusable (its actor died, its engine loop
  crashed or stopped). It leaves routing at once and rejoins when a health probe
  answers again (a restarted worker answers with a new incarnation).

A worker that merely does not answer is neither: the router's health probes decide,
after ``RouterConfig.health_timeout_s`` of failed probes, that it has left.

Plain enum and exceptions, no torch: both sides import this module, and the
transfer backends report their own failures with the same ``FailReason``.
"""

from __future__ import annotations

import enum


class FailReason(str, enum.Enum):  # noqa: UP042 (StrEnum would change str() in logs)
    """Why a transfer or a request's attempt ended without its result."""

    # A KV transfer (the kv_transfer backends' events).
    ABORTED = "aborted"  # abort() on this side or on the peer
    TIMEOUT = "timeout"  # expect() / send timeout passed
    PEER_DIED = "peer_died"  # the other process went away (or closed its channel)
    TRANSPORT = "transport"  # the backend reported an error
    CLOSED = "closed"  # this side was closed with the request pending
    # A request's attempt on a worker (the router's retry decisions).
    NOT_CONNECTED = "not_connected"  # the prefill worker has no channel to that decode worker
    WORKER_DIED = "worker_died"  # the worker's actor died or its loop stopped
    UNHEALTHY = "unhealthy"  # the worker failed its health probes past the limit
    STREAM_LOST = "stream_lost"  # the worker's token stream to the router broke


class AttemptFailed(RuntimeError):
    """One request's attempt failed on a worker; the worker keeps serving."""

    def __init__(self, reason: FailReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[FailReason, str]]:  # pickles across Ray
        return type(self), (self.reason, self.message)


class WorkerGone(RuntimeError):
    """The worker is unusable: its actor died or its engine loop is not running."""

    reason = FailReason.WORKER_DIED
