"""gRPC front door over a scripted test router: streaming, errors, cancel, health,
bad requests (corrupt messages, bad request ids), leaky messages, API keys.
(``test_grpc_router.py`` drives a real router.)"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.protos import build, pb, pb_grpc
from pdserve.router.api.keys import ApiKeys
from pdserve.router.api.public_errors import GENERIC
from pdserve.router.grpc.server import (
    REQUEST_ID_KEY,
    RETRY_AFTER_KEY,
    SERVICE_NAME,
    STATUS_OF,
    GenerationServicer,
)
from pdserve.router.types import (
    ErrorKind,
)
from tests.router.grpc_helpers import ScriptedRouter, collect, expect_status, serve
from tests.waiting import until_async


def test_streams_chunks_then_final() -> None:
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        request = pb.GenerateRequest(
            request_id="r1",
            model="tiny",
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            params=pb.SamplingParameters(max_tokens=3, temperature=0.5, logprobs=2),
        )
        out = await collect(channel, request)
        assert [r.WhichOneof("kind") for r in out] == ["chunk"] * 3 + ["final"]
        assert [list(r.chunk.token_ids) for r in out[:3]] == [[5], [6], [7]]
        lp = out[0].chunk.logprobs[0]
        assert (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) == (
            5,
            -0.5,
            [(5, -0.5), (0, -1.5)],
        )
        final = out[-1].final
        assert final.finish_reason == "stop" and final.stop_token_id == 7
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 3)
        assert final.usage.cached_tokens == 1 and final.num_retries == 1
        assert final.timings.ttft_s == pytest.approx(0.03)
        assert final.timings.tpot_s == pytest.approx(0.02)
        assert final.timings.HasField("router_queue_s")
        assert (final.timings.spec_draft_tokens, final.timings.spec_accepted_tokens) == (6, 4)
        assert not final.timings.HasField("kv_transfer_s")  # stage absent -> unset

    serve(router, scenario)
    (req,) = router.requests
    assert req.request_id == "r1" and req.prompt_token_ids == [5, 6, 7]
    assert req.params.max_tokens == 3 and req.params.temperature == 0.5
    assert req.params.top_p == 1.0  # unset optional -> SamplingParams default
    assert req.timeout_s is None


def test_prompt_kinds_request_id_and_deadline() -> None:
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
        await collect(channel, pb.GenerateRequest(chat=chat, timeout_s=0.5))
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(text="ab", timeout_s=300), timeout=5)
        assert len([r async for r in call]) == 3
        assert dict(await call.initial_metadata())[REQUEST_ID_KEY] == router.requests[1].request_id

    serve(router, scenario)
    chat_req, text_req = router.requests
    assert chat_req.messages == [{"role": "user", "content": "hi"}]
    assert len(chat_req.request_id) == 32  # made by the server: uuid4 hex
    assert chat_req.timeout_s == 0.5
    assert text_req.prompt == "ab"
    # The gRPC deadline (5 s) is earlier than timeout_s (300 s), so it wins.
    assert text_req.timeout_s is not None and 0 < text_req.timeout_s < 10


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        (ErrorKind.INVALID, grpc.StatusCode.INVALID_ARGUMENT),
        (ErrorKind.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (ErrorKind.OVERLOADED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ErrorKind.NOT_READY, grpc.StatusCode.UNAVAILABLE),
        (ErrorKind.DEADLINE, grpc.StatusCode.DEADLINE_EXCEEDED),
        (ErrorKind.INTERNAL, grpc.StatusCode.INTERNAL),
    ],
)
def test_router_errors_map_to_status(kind: ErrorKind, code: grpc.StatusCode) -> None:
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        err = await expect_status(channel, pb.GenerateRequest(request_id="e1",
                                                              text=f"error:{kind.value}"))
        assert err.code() == code
        if kind is ErrorKind.INTERNAL:  # never the router's text: it may hold worker insides
            assert err.details() == ("internal error (request id e1; details are in the "
                                     "server log)")
        else:
            assert err.details() == f"scripted {kind.value}"
        trailing = dict(err.trailing_metadata() or ())
        assert (trailing.get(RETRY_AFTER_KEY) == "2.5") == (kind is ErrorKind.OVERLOADED)
        # Mid-stream: the chunk already sent arrives, then the status.
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(text=f"midstream:{kind.value}"))
        first = await call.read()
        assert list(first.chunk.token_ids) == [ord("m")]
        assert await call.code() == code

    serve(router, scenario)


def test_request_validation_errors() -> None:
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        bad = {
            "top_p": pb.SamplingParameters(top_p=1.5),
            "max_tokens": pb.SamplingParameters(max_tokens=0),
            "presence_penalty": pb.SamplingParameters(presence_penalty=3.0),
            "logprobs": pb.SamplingParameters(logprobs=21),
        }
        for field, params in bad.items():
            err = await expect_status(channel, pb.GenerateRequest(text="x", params=params))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.details()
        err = await expect_status(channel, pb.GenerateRequest(model="tiny"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.details()
        err = await expect_status(channel, pb.GenerateRequest(text="x", timeout_s=-1))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in err.details()
        err = await expect_status(channel, pb.GenerateRequest(text="x", model="gpt-9"))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "gpt-9" in err.details()
        err = await expect_status(channel, pb.GenerateRequest(text="crash"))
        assert err.code() == grpc.StatusCode.INTERNAL

    serve(router, scenario)
    assert len(router.requests) == 1  # only "crash" reached the router


@pytest.mark.parametrize("rid", ["a\nb", "é", "x" * 129, "two words", "\x00"])
def test_bad_request_id_is_invalid_argument(rid: str) -> None:
    # Before: the id went into the initial metadata as it was, and grpc failed: INTERNAL.
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        err = await expect_status(channel, pb.GenerateRequest(request_id=rid, text="x"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request id" in err.details()

    serve(router, scenario)
    assert router.requests == []


def raw_call(channel: grpc.aio.Channel, method: str, payload: bytes, **kw: Any) -> Any:
    """Call ``/pdserve.v1.Generation/<method>`` with ``payload`` as the wire bytes."""
    path = f"/{SERVICE_NAME}/{method}"
    if method == "Generate":
        return channel.unary_stream(path, response_deserializer=pb.GenerateResponse.FromString)(
            payload, **kw)
    return channel.unary_unary(path, response_deserializer=pb.ListModelsResponse.FromString)(
        payload, **kw)


CORRUPT = [
    b"\xff\xff\xff",  # wire format
    b"\x0a\x05ab",  # a length running past the end
    b"\x08" + b"\xff" * 11,  # a varint of 11 bytes
]
BAD_UTF8 = pb.GenerateRequest(text="hi").SerializeToString().replace(b"hi", b"\xc3\x28")


def test_corrupt_messages_are_invalid_argument() -> None:
    # Before: grpc's deserializer failed first and the client saw UNKNOWN.
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        calls = [(m, p) for p in CORRUPT for m in ("Generate", "ListModels")]
        # (To ListModelsRequest, which has no fields, the bad text is an unknown field.)
        for method, payload in [*calls, ("Generate", BAD_UTF8)]:
            call = raw_call(channel, method, payload)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if method == "Generate":
                    _ = [r async for r in call]
                else:
                    await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload)
            assert "not a valid pdserve.v1." in info.value.details()
        # An empty message is a valid one (every field unset).
        assert len((await raw_call(channel, "ListModels", b"")).models) == 1

    serve(router, scenario)
    assert router.requests == []


@pytest.mark.parametrize("kind", [ErrorKind.INVALID, ErrorKind.NOT_READY, ErrorKind.OVERLOADED])
def test_messages_with_server_internals_are_not_shown(kind: ErrorKind,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        err = await expect_status(channel, pb.GenerateRequest(request_id="k1",
                                                              text=f"leak:{kind.value}"))
        assert err.code() == STATUS_OF[kind]
        assert err.details() == GENERIC[kind]
        for secret in ("4242", "10.1.2.3", "/opt/", "8d1a2c3b", "\x1b", "ray::"):
            assert secret not in err.details()

    serve(ScriptedRouter(), scenario)
    # The operator still finds the whole message, with the request id.
    assert any("k1" in r.getMessage() and "10.1.2.3" in r.getMessage() for r in caplog.records)


def test_api_keys_guard_every_call_but_health() -> None:
    router = ScriptedRouter()
    keys = ApiKeys(["k-old", "k-new"])
    good = (("authorization", "Bearer k-new"),)

    async def scenario(channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.GenerationStub(channel)
        for metadata in [(), (("authorization", "Bearer nope"),), (("authorization", "k-new"),),
                         (("authorization", "Basic k-new"),)]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(channel, pb.GenerateRequest(text="ab"), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Even a corrupt message is turned away before it is read.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in raw_call(channel, "Generate", CORRUPT[0])]
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len((await stub.ListModels(pb.ListModelsRequest(), metadata=good)).models) == 1
        out = await collect(channel, pb.GenerateRequest(text="ab"),
                            metadata=(("authorization", "bearer k-old"),))
        assert out[-1].WhichOneof("kind") == "final"
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    serve(router, scenario, api_keys=keys)
    assert len(router.requests) == 1


def test_protect_probes_guards_health_too() -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""),
                                   metadata=(("authorization", "Bearer k"),))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    serve(ScriptedRouter(), scenario, api_keys=ApiKeys(["k"]), protect_probes=True)


def test_client_cancel_closes_router_stream() -> None:
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(request_id="c1", text="hang"))
        await call.read()
        call.cancel()
        # A gRPC deadline passing mid-stream ends the handler the same way.
        call = stub.Generate(pb.GenerateRequest(request_id="d1", text="hang"), timeout=0.3)
        await call.read()
        assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until_async("both handlers to end", lambda: {"c1", "d1"} <= set(router.exits))

    serve(router, scenario)
    assert router.exits["c1"] in ("cancelled", "aclose")
    assert router.exits["d1"] in ("cancelled", "aclose")


class _WriteFailsContext:
    """A servicer context whose first write finds the client gone."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    async def write(self, message: Any) -> None:
        raise asyncio.CancelledError


def test_handler_acloses_router_stream_when_write_fails() -> None:
    # The router is suspended at `yield`, not at an await: only aclose() reaches it.
    router = ScriptedRouter()
    servicer = GenerationServicer(router)
    context: Any = _WriteFailsContext()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(servicer.Generate(pb.GenerateRequest(request_id="w1", text="abc"), context))
    assert router.exits == {"w1": "aclose"}


def test_list_models() -> None:
    async def scenario(channel: grpc.aio.Channel) -> None:
        reply = await pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest())
        assert [(m.id, m.max_model_len, m.owned_by) for m in reply.models] == [
            ("tiny", 2048, "pdserve")
        ]

    serve(ScriptedRouter(), scenario)


def test_health_follows_ready() -> None:
    router = ScriptedRouter()
    router.is_ready = False
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def wait_for(stub: Any, status: int) -> None:
        for _ in range(500):
            got = [
                (await stub.Check(health_pb2.HealthCheckRequest(service=s))).status
                for s in ("", SERVICE_NAME)
            ]
            if got == [status, status]:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"health stayed {got}, wanted {status}")

    async def scenario(channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        await wait_for(stub, not_serving)
        router.is_ready = True
        await wait_for(stub, serving)
        router.is_ready = False
        await wait_for(stub, not_serving)

    serve(router, scenario)


def test_build_from_scratch_and_staleness(tmp_path: Path) -> None:
    proto_root = tmp_path / "protos"
    shutil.copytree(build.PROTO_ROOT, proto_root)
    gen = tmp_path / "gen"
    assert build.needs_build(proto_root, gen)
    written = build.build(proto_root, gen)
    stub = gen / "pdserve" / "v1" / "pdserve_pb2_grpc.py"
    assert {stub, gen / "pdserve" / "v1" / "pdserve_pb2.py"} <= set(written)
    # The stub imports its sibling through the package path, not `import pdserve_pb2`.
    assert "from pdserve.protos.gen.pdserve.v1 import pdserve_pb2 as" in stub.read_text()
    assert (gen / "pdserve" / "v1" / "__init__.py").is_file()
    assert not build.needs_build(proto_root, gen)
    proto = proto_root / "pdserve" / "v1" / "pdserve.proto"
    later = stub.stat().st_mtime + 10
    os.utime(proto, (later, later))  # an edited .proto makes the output stale
    assert build.needs_build(proto_root, gen)


def test_fresh_checkout_generates_on_first_import(tmp_path: Path) -> None:
    # A checkout with no generated code at all: `from pdserve.protos import pb` builds it.
    repo = tmp_path / "repo"
    shutil.copytree(build.PROTO_ROOT, repo / "protos")
    package = repo / "pdserve" / "protos"
    (package / "gen").mkdir(parents=True)
    (repo / "pdserve" / "__init__.py").write_text("")
    for name in ("__init__.py", "build.py", "gen/.gitignore"):
        shutil.copy(build.GEN_DIR.parent / name, package / name)
    code = (
        "from pdserve.protos import pb, pb_grpc\n"
        "print(pb.GenerateRequest(text='hi').SerializeToString().hex(), pb_grpc.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    hex_request, stub_file = done.stdout.split()
    assert hex_request == pb.GenerateRequest(text="hi").SerializeToString().hex()
    assert Path(stub_file).resolve().is_relative_to(package / "gen")
