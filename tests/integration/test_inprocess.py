"""Router + prefill/decode workers in one process (local transfer backend, no Ray):
the disaggregated path's logic, fast."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.router.clients import LocalDecodeClient, LocalPrefillClient
from pdserve.router.router import Router, RouterConfig
from pdserve.router.types import ErrorKind, FinalChunk, GenerateRequest, RouterError, StreamChunk

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


class Pair:
    def __init__(self, model: Path, n_prefill: int = 1, n_decode: int = 1,
                 decode_blocks: int = 128, **router_kw: object) -> None:
        self.prefill = [PrefillWorker(f"prefill-{i}", model, EngineConfig(role="prefill", num_blocks=128),
                                      "local") for i in range(n_prefill)]
        self.decode = [DecodeWorker(f"decode-{i}", model, EngineConfig(role="decode",
                                                                 num_blocks=decode_blocks),
                                    "local", kv_timeout_s=5) for i in range(n_decode)]
        for p in self.prefill:
            for d in self.decode:
                p.connect(d.worker_id, d.endpoint().result()).result()
        tok = self.prefill[0].engine.tokenizer
        assert tok is not None
        self.router = Router("tiny", tok, 2048, [LocalPrefillClient(p) for p in self.prefill],
                             [LocalDecodeClient(d) for d in self.decode],
                             RouterConfig(**router_kw))  # type: ignore[arg-type]

    def close(self) -> None:
        for w in [*self.prefill, *self.decode]:
            w.check_integrity().result()
            assert w.engine.pool.num_used == 0, f"{w.worker_id} leaked blocks"
            w.close()


@pytest.fixture
def pair_factory(tiny_model: Callable[[str], Path]) -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(**kw: object) -> Pair:
        made.append(Pair(tiny_model("llama-gqa"), **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for p in made:
        p.close()


async def collect(stream: AsyncIterator[StreamChunk | FinalChunk]) -> tuple[list[int], str, FinalChunk]:
    tokens: list[int] = []
    text = ""
    async for item in stream:
        if isinstance(item, StreamChunk):
            tokens += item.token_ids
            text += item.text
        else:
            return tokens, text, item
    raise AssertionError("no final chunk")


def test_disaggregated_equals_colocated(pair_factory: Callable[..., Pair],
                                        tiny_model: Callable[[str], Path]) -> None:
    pair = pair_factory()
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompts = [list(range(5, 5 + n)) for n in (3, 16, 17, 50)]
    expected = eng.generate(prompts, GREEDY)

    async def main() -> list[tuple[list[int], str, FinalChunk]]:
        await pair.router.start()
        try:
            return await asyncio.gather(*(
                collect(pair.router.generate(GenerateRequest(f"r{i}", GREEDY,
                                                             prompt_token_ids=p)))
                for i, p in enumerate(prompts)))
        finally:
            await pair.router.stop()

    results = asyncio.run(main())
    for (tokens, text, final), exp in zip(results, expected, strict=True):
        assert tokens == exp.token_ids
        assert text == exp.text
        assert final.finish_reason == "length"
        assert final.usage.completion_tokens == 24
        t = final.timings
        assert t.ttft is not None and t.prefill is not None and t.kv_transfer is not None
        assert t.router_queue is not None and t.e2e is not None and len(t.inter_token) == 23


def test_cancel_mid_stream_frees_blocks(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def main() -> None:
        await pair.router.start()
        try:
            stream = pair.router.generate(GenerateRequest(
                "c", SamplingParams(max_tokens=500, ignore_eos=True), prompt_token_ids=[5] * 40))
            got = 0
            async for item in stream:
                got += isinstance(item, StreamChunk)
                if got == 3:
                    break
            await stream.aclose()  # type: ignore[attr-defined]
            for _ in range(100):  # the abort reaches the workers' loops asynchronously
                if all(w.engine.pool.num_used == 0 for w in pair.decode):
                    break
                await asyncio.sleep(0.02)
        finally:
            await pair.router.stop()

    asyncio.run(main())


def test_bad_input_and_overload(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(decode_blocks=12, queue_timeout_s=0.3)

    async def main() -> None:
        await pair.router.start()
        try:
            with pytest.raises(RouterError) as e:
                await collect(pair.router.generate(GenerateRequest("e", GREEDY, prompt="")))
            assert e.value.kind is ErrorKind.INVALID
            with pytest.raises(RouterError) as e:
                await collect(pair.router.generate(GenerateRequest(
                    "m", GREEDY, messages=[{"role": "nobody"}])))
            assert e.value.kind is ErrorKind.INVALID
            # Hold 10 of the decode worker's 12 blocks with a reservation whose KV
            # never comes: a 100-token prompt (7 blocks) must wait, then get 429.
            held = pair.decode[0].reserve("hold", [7] * 150, GREEDY).result()
            assert held is not None
            with pytest.raises(RouterError) as e:
                await collect(pair.router.generate(GenerateRequest(
                    "b2", GREEDY, prompt_token_ids=[9] * 100)))
            assert e.value.kind is ErrorKind.OVERLOADED and e.value.retry_after_s
            pair.decode[0].abort("hold")
            tokens, _, _ = await collect(pair.router.generate(GenerateRequest(
                "ok", GREEDY, prompt_token_ids=[9] * 10)))
            assert len(tokens) == 24
        finally:
            await pair.router.stop()

    asyncio.run(main())


def test_duplicate_request_id_in_flight_is_rejected(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def main() -> None:
        await pair.router.start()
        try:
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            first = pair.router.generate(GenerateRequest("same", long, prompt_token_ids=[5] * 8))
            await first.__anext__()
            with pytest.raises(RouterError) as e:
                await collect(pair.router.generate(GenerateRequest(
                    "same", GREEDY, prompt_token_ids=[6] * 8)))
            assert e.value.kind is ErrorKind.INVALID and "in flight" in e.value.message
            await first.aclose()  # type: ignore[attr-defined]
            tokens, _, _ = await collect(pair.router.generate(GenerateRequest(
                "same", GREEDY, prompt_token_ids=[6] * 8)))  # free again once finished
            assert len(tokens) == 24
        finally:
            await pair.router.stop()

    asyncio.run(main())


def test_file_sd_follows_live_workers(pair_factory: Callable[..., Pair], tmp_path: Path) -> None:
    import json

    from pdserve.deploy.file_sd import FileSD, cluster_targets
    from pdserve.deploy.serve import _track_workers

    pair = pair_factory(n_prefill=2)
    workers = {"prefill-0": ("127.0.0.1", 9001), "prefill-1": ("127.0.0.1", 9002),
               "decode-0": ("127.0.0.1", 9003)}
    file_sd = FileSD(tmp_path / "sd.json")

    async def main() -> list[str]:
        file_sd.update(cluster_targets("tiny", ("127.0.0.1", 8000), workers))
        task = asyncio.create_task(_track_workers(file_sd, pair.router, ("127.0.0.1", 8000),
                                                  workers, interval_s=0.02))
        pair.router._mark("prefill-1", RuntimeError("killed for the test"))
        await asyncio.sleep(0.2)
        task.cancel()
        groups = json.loads((tmp_path / "sd.json").read_text())
        return sorted(g["labels"]["worker"] for g in groups)

    assert asyncio.run(main()) == ["decode-0", "prefill-0", "router"]
