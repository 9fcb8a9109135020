"""Bounds on what clients can hold of the HTTP server (``router/http/server.py``,
``http.middleware.BodyLimitMiddleware``): a body that does not arrive in time gets a
408 and its connection closed; a request head trickled a byte at a time is cut off; past
the connection cap new requests get a 503; and through all of it the server answers
others."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.http.app import build_app, start_http_server
from pdserve.router.types import FinalChunk, Usage
from tests.router.http_helpers import Client, ScriptedRouter

DEADLINE_S = 20.0  # bound on every wait below (the server's own timeouts are far shorter)


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(DEADLINE_S):
        return await reader.read()  # until the server closes the connection


def test_slow_clients_are_cut_off_and_others_served(tiny_model: Callable[[str], Path]) -> None:
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [FinalChunk("stop", Usage(1, 0))]

    async def main() -> None:
        app = build_app(router, "tiny", CollectorRegistry(), body_timeout_s=0.5)
        server, port = await start_http_server(app, "127.0.0.1", 0, header_timeout_s=0.5,
                                               max_connections=40)
        try:
            # 30 clients declare 100 bytes and send 10; 5 trickle a request head.
            slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
            for _, w in slow:
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                        b'{"prompt":')
            trickle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
            for _, w in trickle:
                w.write(b"POST /v1/comp")
            async with Client(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as c:
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 200, r.text  # others are served meanwhile
                answers = await asyncio.gather(*(_read_all(r) for r, _ in slow))
                assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0]
                cut = await asyncio.gather(*(_read_all(r) for r, _ in trickle))
                assert cut == [b""] * 5  # closed without an answer
                # The connection cap: 40 held open, the next request gets a 503.
                held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 503
                for _, w in held:
                    w.close()
                for _ in range(200):  # the server sees them go
                    r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    if r.status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                assert r.status_code == 200
            for _, w in [*slow, *trickle]:
                w.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_connections_send_small_writes_at_once(tiny_model: Callable[[str], Path]) -> None:
    """Nagle's algorithm is off on every accepted connection. With it on, a stream's
    first SSE event (a small write right after the response head) waited for the
    client's delayed ACK on a keep-alive connection: +40 ms on the TTFT of every
    request but a connection's first, as `vllm bench serve` measured it. asyncio turns
    it off only for sockets whose protocol is TCP, which a listener made with
    ``socket(AF_INET, SOCK_STREAM)`` (protocol 0) was not."""
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [FinalChunk("stop", Usage(1, 0))]

    async def main() -> None:
        app = build_app(router, "tiny", CollectorRegistry())
        server, port = await start_http_server(app, "127.0.0.1", 0)
        try:
            async with Client(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as c:
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 200, r.text
                conns = server.connections()  # the client's, kept alive
                assert conns
                for sock in conns:
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), sock
        finally:
            await server.stop()

    asyncio.run(main())
