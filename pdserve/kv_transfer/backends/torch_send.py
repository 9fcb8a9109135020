"""Prefill side of the `torch` backend.

connect() (its dial half, off the channel's thread) joins D's TCPStore, takes a pair number, says hello with its layout (D answers
ok or the mismatch) and builds the pair's process groups (torch_group). Each peer gets
a PeerWorker thread; send() only numbers the request's messages and queues them. The
thread gathers each message's blocks into one staging buffer (messages are cut at
chunk_bytes, default 64 MiB: gloo costs ~0.2 ms per message, so large buffers) and sends
header then payload. While idle it sends a PING every PING_INTERVAL_S so D can tell a
silent peer from a dead one, and so D's receive thread can notice D closing.
"""

from __future__ import annotations

import datetime
import json
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..layout import KVLayout, KVLayoutMismatch, Slice
from ..regions import Staging
from ..send_worker import Job, PeerWorker, ThreadedSender
from ..wire import Kind, Message, encode, pack
from .torch_group import (
    PING_INTERVAL_S,
    RECEIVER_RANK,
    SENDER_RANK,
    TAG,
    make_groups,
    pair_prefix,
    sync,
)


class _Pair:
    """One connected decode worker: its store, groups, staging buffer and thread."""

    def __init__(self, sender: TorchSender, endpoint: dict[str, Any], name: str) -> None:
        self.endpoint = endpoint
        self.num_blocks = int(endpoint["num_blocks"])
        timeout = datetime.timedelta(seconds=sender.connect_timeout_s)
        self.store = dist.TCPStore(
            endpoint["host"], int(endpoint["port"]), is_master=False, timeout=timeout
        )
        n = self.store.add("pairs", 1) - 1
        self.store.set(pair_prefix(n) + "hello", json.dumps(sender.layout.to_dict()))
        reply = self.store.get(pair_prefix(n) + "reply").decode()
        if reply != "ok":
            raise KVLayoutMismatch(reply.removeprefix("error: "))
        self.ctrl, self.bulk = make_groups(
            self.store, n, SENDER_RANK, sender.kv.device, sender.peer_timeout_s
        )
        self.sender = sender
        self.staging = Staging(sender.kv.device)
        self.worker = PeerWorker(
            name, self.transmit, sender.state.completions, self.ping, PING_INTERVAL_S
        )

    def transmit(self, job: Job) -> None:
        layout, kv = self.sender.layout, self.sender.kv
        size = encode(job.msg, layout)[0][-1]
        header, payload = pack(job.msg, layout, kv, list(job.src), self.staging.take(size))
        works = [self.ctrl.send([torch.tensor(header, dtype=torch.int64)], RECEIVER_RANK, TAG)]
        if header[-1]:
            sync(kv.device)  # gather finished before the payload leaves
            works.append(self.bulk.send([payload], RECEIVER_RANK, TAG))
        for w in works:
            w.wait()
        sync(kv.device)  # staging may be reused

    def ping(self) -> None:
        self.transmit(Job(Message(Kind.PING)))


@dataclass(frozen=True)
class _Dialed:
    peer_id: str
    cut: Slice
    pair: _Pair


class TorchSender(ThreadedSender):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        peer_timeout_s: float = 10.0,
        chunk_bytes: int = 64 << 20,
    ) -> None:
        super().__init__(kv, layout, timeout_s)
        self.connect_timeout_s = connect_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.chunk_bytes = chunk_bytes
        self.bye_timeout_s = peer_timeout_s
        self._pairs: dict[str, _Pair] = {}  # (their threads: ThreadedSender's)

    def connect(self, endpoint: dict[str, Any]) -> str:
        return self.attach(self.dial(endpoint))

    def dial(self, endpoint: dict[str, Any]) -> _Dialed:
        """The rendezvous on D's store and the pair's groups: each waits on D (up to
        connect_timeout_s / peer_timeout_s when D is stalled)."""
        cut = self._plan(endpoint)
        peer_id = f"torch-{endpoint['host']}:{endpoint['port']}-{uuid.uuid4().hex[:8]}"
        return _Dialed(peer_id, cut, _Pair(self, endpoint, f"kv-send-{peer_id}"))

    def attach(self, dialed: _Dialed) -> str:
        self._pairs[dialed.peer_id] = dialed.pair
        return self._add_peer(dialed.peer_id, dialed.cut, dialed.pair.worker,
                              dialed.pair.num_blocks)
