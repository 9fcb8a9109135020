"""Peer hosts for the contract suite: a worker-like process holding senders/receivers.

A `ProcHost` is a spawned process driven over a Pipe; like an engine loop, it polls every
object it holds about every millisecond and buffers the events until the test asks.
`LocalHost` is the same interface in-process (the `local` backend needs both roles in
one process). Tests see `Peer` handles: call a method remotely, fetch events, digest
blocks, close.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.kv_transfer import KVLayout, make_receiver, make_sender

from .kvdata import digest, make_kv

POLL_INTERVAL_S = 0.001


class _Objects:
    """The objects one host holds, their buffered events, and the command handlers."""

    def __init__(self) -> None:
        self.objs: dict[int, Any] = {}
        self.events: dict[int, list[Any]] = {}
        self.next_id = 0

    def handle(self, cmd: str, args: tuple[Any, ...]) -> Any:
        if cmd == "make":
            role, backend, layout_dict, num_blocks, seed, opts = args
            layout = KVLayout.from_dict(layout_dict)
            kv = make_kv(layout, num_blocks, seed)
            factory = make_sender if role == "sender" else make_receiver
            obj = factory(backend, kv, layout, **opts)
            self.next_id += 1
            self.objs[self.next_id], self.events[self.next_id] = obj, []
            return self.next_id
        if cmd == "call":
            oid, method, a, kw = args
            value = getattr(self.objs[oid], method)
            return value(*a, **kw) if callable(value) else value
        if cmd == "events":
            (oid,) = args
            self.poll_one(oid)
            out, self.events[oid] = self.events[oid], []
            return out
        if cmd == "inflight":  # a sender's messages of one request not finished yet
            oid, rid = args
            self.poll_one(oid)
            return self.objs[oid].state.inflight(rid)
        if cmd == "digest":
            oid, ids, layers = args
            blocks = self.objs[oid].kv[ids]
            return digest(blocks if layers is None else blocks[:, layers[0] : layers[1]])
        if cmd == "close":
            (oid,) = args
            obj = self.objs.pop(oid)
            obj.close()
            return self.events.pop(oid) + obj.poll()
        raise ValueError(f"unknown command {cmd}")

    def poll_one(self, oid: int) -> None:
        if oid in self.objs:
            self.events[oid].extend(self.objs[oid].poll())

    def poll_all(self) -> None:
        for oid in list(self.objs):
            self.poll_one(oid)


def _host_main(conn: Connection, env: dict[str, str], ray_address: str | None) -> None:
    os.environ.update(env)  # before nixl/UCX or ray read it
    torch.set_num_threads(1)
    if ray_address:
        import ray

        ray.init(address=ray_address, _node_ip_address="127.0.0.2", log_to_driver=False)
    objects = _Objects()
    while True:
        if conn.poll(POLL_INTERVAL_S):
            cmd, args = conn.recv()
            if cmd == "exit":
                for oid in list(objects.objs):
                    objects.handle("close", (oid,))
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", objects.handle(cmd, args)))
            except Exception as exc:
                conn.send(("err", exc))
        objects.poll_all()


class ProcHost:
    """A spawned peer process."""

    def __init__(self, env: dict[str, str] | None = None, ray_address: str | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_host_main, args=(child, env or {}, ray_address), daemon=True
        )
        self.proc.start()
        child.close()

    def request(self, cmd: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer host did not answer {cmd} within {timeout_s}s")
        status, value = self._conn.recv()
        if status == "err":
            raise value
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def shutdown(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.request("exit", timeout_s=20)
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


class LocalHost:
    """The same interface, in this process (local backend)."""

    def __init__(self) -> None:
        self._objects = _Objects()

    def request(self, cmd: str, *args: Any, timeout_s: float = 60.0) -> Any:
        return self._objects.handle(cmd, args)

    def shutdown(self) -> None:
        for oid in list(self._objects.objs):
            self._objects.handle("close", (oid,))


class Peer:
    """A sender or receiver living in some host."""

    def __init__(self, host: ProcHost | LocalHost, oid: int) -> None:
        self.host, self.oid = host, oid
        self.closed = False

    @classmethod
    def make(
        cls,
        host: ProcHost | LocalHost,
        role: str,
        backend: str,
        layout: KVLayout,
        num_blocks: int,
        seed: int,
        **opts: Any,
    ) -> Peer:
        oid = host.request("make", role, backend, layout.to_dict(), num_blocks, seed, opts)
        return cls(host, oid)

    def __getattr__(self, method: str) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            return self.host.request("call", self.oid, method, a, kw)

        return call

    def events(self) -> list[Any]:
        return list(self.host.request("events", self.oid))

    def inflight(self, request_id: str) -> int:
        return int(self.host.request("inflight", self.oid, request_id))

    def digest(self, ids: list[int], layers: tuple[int, int] | None = None) -> str:
        return str(self.host.request("digest", self.oid, ids, layers))

    def close(self) -> list[Any]:
        if self.closed:
            return []
        self.closed = True
        return list(self.host.request("close", self.oid))


def collect(peers: list[Peer], want: list[int], timeout_s: float) -> list[list[Any]]:
    """Gather events from each peer until peers[i] has >= want[i] of them (or timeout)."""
    got: list[list[Any]] = [[] for _ in peers]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, peer in enumerate(peers):
            got[i].extend(peer.events())
        if all(len(g) >= w for g, w in zip(got, want, strict=True)):
            break
        time.sleep(0.005)
    return got
