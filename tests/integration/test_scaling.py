"""Scaling a running Ray cluster through the admin API while load runs: 1P+1D ->
1P+2D -> 2P+2D -> 1P+1D with ``pdserve scale`` (the CLI, over HTTP with an API key;
the last step names the decode worker that leaves: its requests move to the other).
No request fails, every one gets the engine's greedy tokens, the new workers serve,
the drained ones leave, and no block is left in use."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from ray.experimental import internal_kv

from pdserve.cli.main import main as cli_main
from pdserve.cluster.actors import restarts_key
from pdserve.cluster.cluster import Cluster, StartupError
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.scaler import Scaler
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.api.keys import ApiKeys
from pdserve.router.http.app import build_app, start_http_server
from pdserve.router.types import GenerateRequest, StreamChunk
from tests.integration.clusters import start
from tests.waiting import until, until_async

pytestmark = pytest.mark.usefixtures("ray_address")  # the session's shared Ray cluster

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = [[5 + (i * 11 + j) % 400 for j in range(6 + 9 * i)] for i in range(6)]
CLIENTS = 4
MAX_PER_CLIENT = 400  # bounds the load loop
KEY = "admin-key"


def _get(url: str, key: str | None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_scale_out_and_in_under_load(tiny_model: Callable[[str], Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model("llama-gqa")
    want = [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=256, dtype="auto")).generate(
        PROMPTS, PARAMS)]
    # every request through a prefill worker (the prompts repeat: a decode worker that
    # holds one would prefill it itself, and the new prefill worker would see few)
    cluster = start(model, "nixl", local_prefill_max_tokens=0)
    figures: list[str] = []
    # every worker's restart record (in Ray's GCS), deleted once it is stopped for good
    started = {h._actor_id.hex() for h in cluster.handles.values()}
    assert all(internal_kv._internal_kv_get(restarts_key(a)) for a in started)

    async def body() -> None:
        router = cluster.make_router()
        await router.start()
        scaler = Scaler(cluster, router, drain_timeout_s=60)
        scaler.start()
        app = build_app(router, "tiny", CollectorRegistry(), api_keys=ApiKeys([KEY]),
                        admin=scaler)
        server, port = await start_http_server(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        done: list[tuple[int, list[int]]] = []  # (prompt index, tokens) of every request
        wrong: list[str] = []  # what each request with other tokens than the engine's got
        stop = asyncio.Event()

        async def client(c: int) -> None:
            for n in range(MAX_PER_CLIENT):
                if stop.is_set():
                    return
                i, rid = (c + n) % len(PROMPTS), f"l{c}-{n}"
                chunks: list[list[int]] = []
                served: set[str] = set()  # the workers of its attempts, as they stream
                final = None
                async for item in router.generate(GenerateRequest(rid, PARAMS,
                                                                  prompt_token_ids=PROMPTS[i])):
                    served |= router.fanout.workers_of(rid)
                    if isinstance(item, StreamChunk):
                        chunks.append(item.token_ids)
                    else:
                        final = item
                assert final is not None
                tokens = [t for chunk in chunks for t in chunk]
                done.append((i, tokens))
                if tokens != want[i]:
                    wrong.append(f"{rid} (prompt {i}, {final.num_retries} retries, "
                                 f"{final.usage.cached_tokens} cached, "
                                 f"{final.timings.kv_bytes} KV bytes, on {sorted(served)}, "
                                 f"during step {len(figures)}): chunks {chunks} != {want[i]}")

        def scale(*flags: str) -> dict[str, object]:
            capsys.readouterr()
            assert cli_main(["scale", "--url", url, "--api-key", KEY, "--json",
                             "--timeout", "300", *flags]) == 0, capsys.readouterr().err
            return json.loads(capsys.readouterr().out.splitlines()[-1])  # after actors' logs

        try:
            # The admin API: keys required; bad sizes are a 400 naming the problem.
            # (Blocking clients run on threads: the server shares this loop.)
            assert (await asyncio.to_thread(_get, f"{url}/admin/workers", None))[0] == 401
            for bad, message in ([["--decode", "0"], "come in pairs"],
                                 [["--prefill", "-1"], "whole number"],
                                 [["--remove", "decode-9"], "no worker 'decode-9'"]):
                capsys.readouterr()
                assert await asyncio.to_thread(
                    cli_main, ["scale", "--url", url, "--api-key", KEY, *bad]) == 2
                assert message in capsys.readouterr().err
            load = [asyncio.create_task(client(c)) for c in range(CLIENTS)]
            steps = [(["--decode", "2"], "decode-1"), (["--prefill", "2"], "prefill-1"),
                     # the first decode worker leaves, named (its requests move)
                     (["--prefill", "1", "--remove", "decode-0"], None)]
            for flags, new in steps:
                t0, n0 = time.monotonic(), len(done)
                status = await asyncio.to_thread(scale, *flags)
                assert status["reached"] and status["error"] is None
                if new is not None:  # the new worker takes requests
                    await until_async(f"requests on {new}", lambda w=new: (
                        w in router.workers.workers
                        and router.workers.workers[w].outstanding_requests > 0), 120)
                await until_async("requests done at this size",
                                  lambda n=n0: len(done) >= n + 2 * CLIENTS, 120)
                started.update(h._actor_id.hex() for h in cluster.handles.values())
                figures.append(f"{status['current']}: {len(done) - n0} requests in "
                               f"{time.monotonic() - t0:.1f}s")
            stop.set()
            await asyncio.gather(*load)
            code, listed = await asyncio.to_thread(_get, f"{url}/admin/workers", KEY)
            assert code == 200
            roles = sorted(w["role"] for w in listed["workers"])  # type: ignore[union-attr]
            assert roles == ["decode", "prefill"]
            assert sorted(cluster.roles.values()) == ["decode", "prefill"]
            assert "decode-1" in cluster.roles  # decode-0 was the one named
        finally:
            stop.set()
            await server.stop()
            await scaler.stop()
            await router.stop()
        assert done and not wrong, "\n".join(wrong)

    try:
        asyncio.run(body())
        cluster.check_integrity()
        until("every block free", lambda: all(
            s.num_free_blocks == s.num_blocks for s in cluster.stats().values()), 30)
    finally:
        cluster.shutdown()
    assert len(started) == 4  # (decode-0, prefill-0, decode-1, prefill-1)
    assert not [a for a in started if internal_kv._internal_kv_get(restarts_key(a))]
    print("scaling under load:", "; ".join(figures))


def test_what_cannot_be_placed_is_refused_naming_it(tiny_model: Callable[[str], Path]) -> None:
    """Asking for more workers than the cluster has room for starts none of them and
    says which resource is short; a pool pinned to labels no node has fails at start."""
    model = tiny_model("llama-gqa")
    cfg = ClusterConfig.from_dict({
        "model": str(model), "prefill": {"workers": 1}, "decode": {
            "workers": 1, "labels": {"pdserve/pool": "decode"}}})
    with pytest.raises(StartupError, match=r"the decode pool needs a node with labels "
                                           r"\{'pdserve/pool': 'decode'\}; no live node"):
        Cluster(cfg).start()
    cluster = start(model, "torch")

    async def body() -> None:
        router = cluster.make_router()
        await router.start()
        scaler = Scaler(cluster, router)
        scaler.start()
        try:
            scaler.set_targets({"decode": 40})
            await until_async("the scaler to give up", lambda: scaler.status()["error"], 60)
            status = scaler.status()
            assert re.fullmatch(r"cannot add 39 decode worker\(s\): they need CPU 39, the Ray "
                                r"cluster has \d+ free", str(status["error"])), status
            assert status["current"] == {"prefill": 1, "decode": 1, "colocated": 0}
            assert not status["reached"] and sorted(cluster.roles) == ["decode-0", "prefill-0"]
        finally:
            await scaler.stop()
            await router.stop()

    try:
        asyncio.run(body())
    finally:
        cluster.shutdown()
