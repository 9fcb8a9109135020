"""A token worker's output stream with several routers: each router gets only the
deltas of the requests assigned to it, and when a router's connection ends the
requests still assigned to it are handed back for aborting (none twice, none of
another router's)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.messages import RequestDelta
from pdserve.output_stream import OutputServer, connect_stream
from tests.waiting import until

WAIT_S = 10.0


class Router:
    """One router's end of the stream: what it received, and whether it was cut."""

    def __init__(self) -> None:
        self.got: list[RequestDelta] = []
        self.lost: list[str] = []

    async def connect(self, server: OutputServer, router_id: str) -> asyncio.Transport:
        return await connect_stream(server.address, self.got.extend, self.lost.append,
                                    router_id=router_id)


async def eventually(what: str, check: object) -> None:
    await asyncio.to_thread(until, what, check, WAIT_S)


def test_each_router_gets_its_own_requests_and_a_lost_router_is_reported() -> None:
    orphaned: list[list[str]] = []
    lock = threading.Lock()

    def on_lost(ids: list[str]) -> None:
        with lock:
            orphaned.append(sorted(ids))

    server = OutputServer(on_router_lost=on_lost)

    async def body() -> None:
        a, b = Router(), Router()
        ta = await a.connect(server, "router-a")
        tb = await b.connect(server, "router-b")
        for rid, owner in (("a1", "router-a"), ("a2", "router-a"), ("b1", "router-b"),
                           ("b2", "router-b")):
            server.assign(rid, owner)
        server.publish([RequestDelta("a1", [1]), RequestDelta("b1", [2]),
                        RequestDelta("a2", [3], finish_reason="stop"),
                        RequestDelta("nobody", [9])])
        await eventually("both routers to get their deltas",
                         lambda: len(a.got) == 2 and len(b.got) == 1)
        assert [(d.request_id, d.token_ids) for d in a.got] == [("a1", [1]), ("a2", [3])]
        assert [(d.request_id, d.token_ids) for d in b.got] == [("b1", [2])]
        assert server.num_assigned == 3  # a2 finished: its owner is forgotten

        server.forget("b2")  # aborted by its router: not an orphan later
        server.assign("b3", "router-b")
        tb.close()
        await eventually("router-b's requests to be reported",
                         lambda: orphaned == [["b1", "b3"]])
        server.publish([RequestDelta("a1", [4]), RequestDelta("b1", [5])])
        await eventually("router-a to get its next delta", lambda: len(a.got) == 3)
        assert a.got[-1].token_ids == [4] and len(b.got) == 1
        assert not a.lost and server.num_assigned == 1
        ta.close()
        await eventually("router-a's request to be reported", lambda: len(orphaned) == 2)
        assert orphaned[1] == ["a1"] and server.num_assigned == 0

    try:
        asyncio.run(body())
    finally:
        server.close()


def test_a_router_reconnecting_keeps_its_requests() -> None:
    orphaned: list[list[str]] = []
    server = OutputServer(on_router_lost=orphaned.append)

    async def body() -> None:
        first, second = Router(), Router()
        old = await first.connect(server, "r")
        server.assign("x", "r")
        await second.connect(server, "r")  # the same router, a new connection
        await eventually("the old connection to be closed", lambda: bool(first.lost))
        server.publish([RequestDelta("x", [7])])
        await eventually("the new connection to get the delta", lambda: len(second.got) == 1)
        assert not first.got and not orphaned and server.num_assigned == 1
        old.close()

    try:
        asyncio.run(body())
    finally:
        server.close()


def test_a_connection_without_the_token_is_refused() -> None:
    server = OutputServer()

    async def body() -> None:
        host, port, token = server.address
        with pytest.raises(ConnectionError):
            await connect_stream((host, port, "0" * len(token)), lambda b: None,
                                 lambda why: None, timeout_s=5.0, router_id="r")

    try:
        asyncio.run(body())
    finally:
        server.close()
