"""One attempt's state machine: what its inbox may hold (one event type per message)
and the transitions those events make, in one place. Pure -- no I/O, no clock:
``orchestrator.RequestRun`` reads the inbox, calls the transition an event names,
and does the rest (streams what it answers, calls P, aborts on both workers).

Two regions advance side by side: ``Phase``, the client's stream (WAITING, then
FIRST_FROM_P when P's first token went out, DECODING once the token worker's tokens
come, FINISHED when the engine ended the request), and ``Leg``, the prefill worker's
two calls. docs/internals.md draws them and says what each event means. An error
delta, a worker's failure or the deadline end the attempt from any phase but
FINISHED: the transition raises the attempt's error. An event the state does not
allow raises ``IllegalTransition``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NoReturn

from pdserve.failures import AttemptFailed, FailReason
from pdserve.messages import FirstToken, RequestDelta
from pdserve.router.types import ErrorKind, RouterError


# ---------------------------------------------------------------- the inbox's events
# A token worker's delta is its own event, ``RequestDelta``, pushed as its stream
# delivers it (``Fanout.deliver``): no wrapper on the per-token path.
@dataclass(frozen=True, slots=True)
class PrefillAnswered:
    """``P.prefill`` returned or raised (its future's done callback): the first token,
    or the failure, is in the leg's future."""


@dataclass(frozen=True, slots=True)
class HandoffAnswered:
    """``P.handoff`` returned (D acknowledged the KV) or raised: in the leg's future."""


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """A worker the attempt depends on died or left routing (``Fanout.fail_worker``)."""

    reason: FailReason
    message: str


@dataclass(frozen=True, slots=True)
class DeadlinePassed:
    """The request's deadline passed (the attempt's timer)."""


@dataclass(frozen=True, slots=True)
class MoveRequested:
    """Move the request to another decode worker (``router/migration.py``): ``reason``
    "drain" (its worker is leaving) or "rebalance"."""

    reason: str


@dataclass(frozen=True, slots=True)
class PrecopyDone:
    """A move's first phase (reserved on the target, its full blocks copied while it
    decodes) ended, or failed: in the move's ``error``."""


@dataclass(frozen=True, slots=True)
class MoveStopped:
    """A move's source let the request go, or would not: in the move's ``stop_at`` /
    ``error``."""


Event = (RequestDelta | PrefillAnswered | HandoffAnswered | WorkerFailed | DeadlinePassed
         | MoveRequested | PrecopyDone | MoveStopped)


# --------------------------------------------------------------------- the states
class Phase(enum.Enum):
    """Where the client's stream is in this attempt."""

    WAITING = "waiting"  # nothing streamed: the prompt is being computed
    FIRST_FROM_P = "first_from_p"  # P's first token is with the client; D's copy is to come
    DECODING = "decoding"  # the token worker's deltas are the stream
    FINISHED = "finished"  # the engine ended the request (or P scored it): nothing to abort


class Leg(enum.Enum):
    """Where the prefill worker's part of this attempt is."""

    NONE = "none"  # a colocated worker, or a decode worker computing the prompt itself
    PREFILLING = "prefilling"  # P.prefill asked; its first token not in
    HANDING_OFF = "handing_off"  # the first token in; P.handoff asked
    HANDED_OFF = "handed_off"  # D has the KV (or nothing was to go): P is no longer needed


class IllegalTransition(RuntimeError):
    """An event the attempt's state does not allow: a bug in the router or a worker's
    protocol, never a fault the attempt can retry."""


class Attempt:
    """The state of one attempt on its token worker (``token_worker``) and, when
    ``remote``, a prefill worker; ``attempt_id`` names the deltas it makes."""

    __slots__ = ("_streamed_first", "attempt_id", "leg", "phase", "request_id", "token_worker")

    def __init__(self, request_id: str, attempt_id: str, token_worker: str,
                 remote: bool) -> None:
        self.request_id = request_id
        self.attempt_id = attempt_id
        self.token_worker = token_worker
        self.phase = Phase.WAITING
        self.leg = Leg.PREFILLING if remote else Leg.NONE
        self._streamed_first: int | None = None  # P's first token, once streamed

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def movable(self) -> bool:
        """Decoding on its token worker alone: its KV can move to another."""
        return self.phase is Phase.DECODING and self.leg in (Leg.NONE, Leg.HANDED_OFF)

    def delta(self, d: RequestDelta) -> RequestDelta:
        """The token worker's delta: what of it goes to the client. An error it
        reports fails the attempt (raised)."""
        self._allow("a token delta", self.phase is not Phase.FINISHED)
        if d.finish_reason == "error":
            raise AttemptFailed(d.failure or FailReason.TRANSPORT,
                                f"{self.token_worker}: {d.error}")
        if not d.token_ids:
            return d
        if self.phase is Phase.FIRST_FROM_P:
            return self._hand_over(d)
        self.phase = Phase.DECODING
        return d

    def _hand_over(self, d: RequestDelta) -> RequestDelta:
        """D's first tokens after P's first token was streamed: D's first token is its
        copy of P's (it came with the KV), which the client has -- never twice."""
        if d.token_ids[0] != self._streamed_first:
            raise IllegalTransition(f"attempt {self.attempt_id}: the decode worker's first "
                                    f"token {d.token_ids[0]} is not P's {self._streamed_first}")
        self.phase = Phase.DECODING
        return d._replace(token_ids=d.token_ids[1:],
                          logprobs=d.logprobs[1:] if d.logprobs else d.logprobs)

    def prefill_answered(self, first: FirstToken) -> RequestDelta | None:
        """P's first token (its answer taken): what goes to the client -- the token,
        while nothing came from the token worker; nothing when D's copy came first, or
        when the token ends the request (D's final delta brings it); the end, when P
        only scored the prompt (max_tokens=0: nothing is handed off)."""
        self._allow("P's first token", self.leg is Leg.PREFILLING
                    and self.phase in (Phase.WAITING, Phase.DECODING))
        if first.token_id is None:
            self.leg, self.phase = Leg.HANDED_OFF, Phase.FINISHED
            return RequestDelta(self.attempt_id, [], finish_reason="length")
        self.leg = Leg.HANDING_OFF
        if self.phase is Phase.DECODING or first.final:
            return None
        self.phase, self._streamed_first = Phase.FIRST_FROM_P, first.token_id
        return RequestDelta(self.attempt_id, [first.token_id],
                            None if first.logprob is None else [first.logprob])

    def handoff_answered(self) -> None:
        """P's hand-off ended: the attempt no longer depends on P."""
        self._allow("P's hand-off answer", self.leg is Leg.HANDING_OFF
                    and self.phase is not Phase.FINISHED)
        self.leg = Leg.HANDED_OFF

    def finish(self, d: RequestDelta) -> None:
        """The token worker's final delta ``d`` goes to the client: the engine ended
        the request and freed it (nothing to abort)."""
        self._allow("the end of the stream", d.finish_reason is not None
                    and self.phase is not Phase.FINISHED)
        self.phase = Phase.FINISHED

    def fail(self, event: WorkerFailed | DeadlinePassed) -> NoReturn:
        """A worker failed (retried elsewhere) or the deadline passed (the request
        ends): the attempt's error."""
        self._allow("a failure", self.phase is not Phase.FINISHED)
        if isinstance(event, WorkerFailed):
            raise AttemptFailed(event.reason, event.message)
        raise RouterError(ErrorKind.DEADLINE, f"request {self.request_id} passed its deadline")

    def _allow(self, event: str, allowed: bool) -> None:
        if not allowed:
            raise IllegalTransition(f"attempt {self.attempt_id}: {event} in phase "
                                    f"{self.phase.value}, leg {self.leg.value}")
