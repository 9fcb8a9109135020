"""The in-process serving stack the router, integration and deploy tests share: a
router over prefill / decode / colocated workers in one process (local transfer
backend, no Ray; the same worker objects the Ray actors hold), and helpers that run
requests through it. The ``pair_factory`` fixture (tests/conftest.py) makes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router, RouterConfig
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk
from pdserve.worker.colocated import ColocatedWorker
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


class Pair:
    """``n_prefill`` x ``n_decode`` workers (and ``n_colocated``) behind one router."""

    def __init__(self, model: Path, n_prefill: int = 1, n_decode: int = 1,
                 decode_blocks: int = 128, n_colocated: int = 0,
                 prefill_engine: dict[str, object] | None = None, kv_timeout_s: float = 5,
                 decode_engine: dict[str, object] | None = None, transfer: str = "local",
                 colocated_engine: dict[str, object] | None = None,
                 **router_kw: object) -> None:
        self.prefill = [PrefillWorker(f"prefill-{i}", model, EngineConfig(**{
            "role": "prefill", "num_blocks": 128, **(prefill_engine or {})}), transfer)  # type: ignore[arg-type]
            for i in range(n_prefill)]
        self.decode = [DecodeWorker(f"decode-{i}", model, EngineConfig(**{  # type: ignore[arg-type]
            "role": "decode", "num_blocks": decode_blocks, **(decode_engine or {})}), transfer,
            kv_timeout_s=kv_timeout_s) for i in range(n_decode)]
        self.colocated = [ColocatedWorker(f"colocated-{i}", model, EngineConfig(**{  # type: ignore[arg-type]
            "role": "colocated", "num_blocks": decode_blocks, **(colocated_engine or {})}))
            for i in range(n_colocated)]
        tok = self.workers[0].engine.tokenizer
        assert tok is not None
        # every prompt through a prefill worker unless a test says otherwise: these
        # tests are of the disaggregated path (test_placement.py: the decision)
        self.router = Router(Path(model).name, tok, 2048, self.workers,
                             RouterConfig(**{"placement": "static", **router_kw}))  # type: ignore[arg-type]

    @property
    def workers(self) -> list[PrefillWorker | DecodeWorker | ColocatedWorker]:
        return [*self.prefill, *self.decode, *self.colocated]

    def used_blocks(self) -> dict[str, int]:
        return {w.worker_id: w.engine.pool.num_used for w in self.workers}

    def close(self) -> None:
        for w in self.workers:
            w.loop.call(w.engine.check_integrity).result()
            assert w.engine.pool.num_used == 0, f"{w.worker_id} leaked blocks"
            w.close()


async def collect(stream: AsyncIterator[StreamChunk | FinalChunk]) -> tuple[list[int], str, FinalChunk]:
    """Read a stream to its end, as the front ends do (the run's cleanup -- its
    workers' counts, which a drain waits on -- runs when the generator ends)."""
    tokens: list[int] = []
    text = ""
    final: FinalChunk | None = None
    async for item in stream:
        assert final is None, "a chunk after the final one"
        if isinstance(item, StreamChunk):
            tokens += item.token_ids
            text += item.text
        else:
            final = item
    assert final is not None, "no final chunk"
    return tokens, text, final


def run(pair: Pair, body: Callable[[Router], object]) -> object:
    async def main() -> object:
        await pair.router.start()
        try:
            return await body(pair.router)  # type: ignore[misc]
        finally:
            await pair.router.stop()

    return asyncio.run(main())


def generate_all(pair: Pair, prompts: list[list[int]]) -> list[tuple[list[int], str, FinalChunk]]:
    """Every prompt through the pair's router at once, greedy; each request's outcome."""
    async def body(router: Router) -> list[tuple[list[int], str, FinalChunk]]:
        return await asyncio.gather(*(
            collect(router.generate(GenerateRequest(f"p{i}", GREEDY, prompt_token_ids=p)))
            for i, p in enumerate(prompts)))

    return run(pair, body)  # type: ignore[return-value]


def draft_first_work(worker: DecodeWorker) -> dict[str, int]:
    """Filled as ``worker``'s draft model runs: request id -> the tokens its mirror
    computed in its first draft run (1 when its prompt's draft KV was handed over)."""
    draft = worker.engine.draft
    assert draft is not None
    first_work: dict[str, int] = {}
    run_draft = draft._run

    def counted(work: list[tuple[Any, int]], rows: dict[str, Any]) -> dict[str, int]:
        for m, n in work:
            first_work.setdefault(m.request_id, n)
        return run_draft(work, rows)

    draft._run = counted  # type: ignore[method-assign]
    return first_work
