"""The `ray` backend: blocks travel through the Ray object store as numpy arrays.

The slow, always-works reference. Needs a connected Ray runtime (ray.init) in both
workers; ray is imported only here and only when this backend is used. No actor classes
of our own: D's receiver creates a library `ray.util.queue.Queue` (named, so its JSON-able
endpoint can be resolved with ray.get_actor) and P puts items into it:

    item = (sender id, message fields as plain Python values, ObjectRef of the block
            data | None)

(Plain values, not wire.Message: the queue actor unpickles each item, and a class of ours
would make it import pdserve and torch — seconds per new receiver.)

The data is the gathered blocks [n, hi-lo, 2, H, bs, D] as one uint8 numpy array (numpy,
not torch: Ray stores numpy zero-copy and would pickle a tensor), put by P in chunks of
at most chunk_bytes. D keeps a few queue.get calls outstanding and, in poll(), copies
each landed chunk into its expected blocks (D does the writes, so abort and timeout take
effect at once). A sender's death shows as its ObjectRefs failing (OwnerDiedError) or,
between messages, only as the request's timeout.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from typing import Any, cast

import torch

from ..base import FailReason, RecvEvent
from ..layout import KVLayout
from ..receiver_base import BaseReceiver
from ..regions import Staging, scatter
from ..send_worker import Job, PeerWorker, ThreadedSender, describe
from ..wire import Kind, Message, data_shape, local_heads

log = logging.getLogger(__name__)

NAMESPACE = "pdserve_kv"
OUTSTANDING_GETS = 8  # queue.get calls kept in flight by a receiver
GET_TIMEOUT_S = 30.0  # bound on fetching one chunk that is already in the object store


def _to_plain(msg: Message) -> tuple[Any, ...]:
    return (
        int(msg.kind),
        msg.request_id,
        msg.seq,
        msg.total,
        list(msg.dst),
        list(msg.layers),
        msg.notify,
        None if msg.heads is None else list(msg.heads),
        msg.part,
        msg.parts,
    )


def _from_plain(fields: tuple[Any, ...]) -> Message:
    kind, rid, seq, total, dst, layers, notify, heads, part, parts = fields
    return Message(Kind(kind), rid, seq, total, tuple(dst), (layers[0], layers[1]), notify,
                   None if heads is None else (heads[0], heads[1]), part, parts)


def _ray() -> Any:
    import ray

    if not ray.is_initialized():
        raise RuntimeError("the ray KV transfer backend needs ray.init() in this process")
    return ray


class RayReceiver(BaseReceiver):
    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        from ray.util.queue import Queue

        super().__init__(kv, layout)
        self._ray = _ray()
        self._name = f"pdserve-kv-{uuid.uuid4().hex[:12]}"
        opts = {"num_cpus": 0, "name": self._name, "namespace": NAMESPACE}
        self._queue = Queue(actor_options=opts)
        self._actor: Any = cast(Any, self._queue.actor)  # ray.remote stubs lack .remote
        self._gets = [self._actor.get.remote() for _ in range(OUTSTANDING_GETS)]
        self._closed = False

    def endpoint(self) -> dict[str, Any]:
        return self._endpoint("ray", queue=self._name, namespace=NAMESPACE)

    def poll(self) -> list[RecvEvent]:
        if not self._closed:
            ready, _ = self._ray.wait(self._gets, num_returns=len(self._gets), timeout=0)
            for ref in ready:  # in queue order: gets are served first come first served
                self._gets.remove(ref)
                self._gets.append(self._actor.get.remote())
                try:
                    sender, fields, data = self._ray.get(ref)
                except Exception as exc:  # our queue actor died: nothing more will come
                    self._broken(describe(exc))
                    break
                self._apply(sender, _from_plain(fields), data)
        return super().poll()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pending()
        self._ray.kill(self._actor)

    def _broken(self, why: str) -> None:
        self._closed = True
        for rid in self._state.pending_ids():
            self._state.end(rid, FailReason.TRANSPORT, f"receive queue lost: {why}")

    def _apply(self, sender: str, msg: Message, ref: Any) -> None:
        if msg.kind == Kind.BYE:
            for rid in self._state.requests_of(sender):
                self._state.end(rid, FailReason.PEER_DIED, "sender closed")
            return
        if msg.kind == Kind.ABORT:
            self._state.end(msg.request_id, FailReason.ABORTED, "aborted by sender")
            return
        if not self._state.may_write(msg.request_id, msg.dst):
            return  # aborted, timed out, or not ours: drop
        self._state.touch(msg.request_id, sender)
        if msg.dst:
            try:
                array = self._ray.get(ref, timeout=GET_TIMEOUT_S)
            except Exception as exc:  # OwnerDiedError when the sender process is gone
                self._state.end(msg.request_id, FailReason.PEER_DIED, describe(exc))
                return
            with warnings.catch_warnings():  # the store's arrays are read-only; we only read
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(array)
            data = raw.view(self.kv.dtype).view(
                data_shape(self.layout, len(msg.dst), msg.layers, msg.heads))
            scatter(self.kv, list(msg.dst), msg.layers, data, local_heads(self.layout, msg.heads))
        self._state.landed(msg.request_id, msg.seq, msg.total, msg.notify, sender, msg.part,
                           msg.parts, msg.dst)


class RaySender(ThreadedSender):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        timeout_s: float = 30.0,
        chunk_bytes: int = 64 << 20,
    ) -> None:
        super().__init__(kv, layout, timeout_s)
        self._ray = _ray()
        self._timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._me = f"ray-sender-{uuid.uuid4().hex[:12]}"

    def connect(self, endpoint: dict[str, Any]) -> str:
        cut = self._plan(endpoint)
        actor = self._ray.get_actor(endpoint["queue"], namespace=endpoint["namespace"])
        peer = str(endpoint["queue"])
        staging = Staging(self.kv.device)  # used by this peer's thread only

        def transmit(job: Job) -> None:
            ref = None
            if job.msg.dst:
                blocks = staging.gather(self.kv, list(job.src), job.msg.layers,
                                        local_heads(self.layout, job.msg.heads)).cpu()
                ref = self._ray.put(blocks.view(-1).view(torch.uint8).numpy())  # copies
            item = (self._me, _to_plain(job.msg), ref)
            self._ray.get(actor.put_nowait.remote(item), timeout=self._timeout_s)

        worker = PeerWorker(f"kv-send-{peer}", transmit, self.state.completions)
        return self._add_peer(peer, cut, worker, int(endpoint["num_blocks"]))
