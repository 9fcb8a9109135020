"""``make bench`` for disaggregated serving on the default model:

- TTFT broken into router queue / prefill queue / prefill / KV transfer for 128- and
  1024-token prompts, per transfer backend, and the transfer's share of TTFT;
- serving throughput of 1 prefill + 1 decode worker (one thread each) against the
  colocated engine on the same two cores (two threads), same requests.

Run: ``python -m pdserve.deploy.bench_serving [--backends nixl,torch,ray]
[--requests 32] [--prompt-len 128] [--output-len 128]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray

from pdserve.deploy.cluster import Cluster, init_local_ray
from pdserve.deploy.config import ClusterConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.gguf_convert import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[100 + (seed * 7919 + i * 104729 + j * 31) % 40000 for j in range(length)]
            for i in range(n)]


async def one(router: Router, rid: str, prompt: list[int], params: SamplingParams) -> FinalChunk:
    async for item in router.generate(GenerateRequest(rid, params, prompt_token_ids=prompt)):
        if not isinstance(item, StreamChunk):
            return item
    raise RuntimeError("no final chunk")


def cluster_config(model: str, transfer: str) -> ClusterConfig:
    return ClusterConfig.from_dict({
        "model": model, "transfer": transfer,
        "prefill": {"num_cpus": 1, "engine": {"max_num_batched_tokens": 2048}},
        "decode": {"num_cpus": 1, "engine": {"max_num_seqs": 64}},
        "router": {"queue_timeout_s": 300},
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backends", default="nixl,torch,ray")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    reqs = prompts(args.requests, args.prompt_len, 1)

    eng = LLMEngine(model, EngineConfig(num_threads=2, max_num_seqs=64))
    eng.generate(reqs[:2], SamplingParams(max_tokens=4))
    t0 = time.perf_counter()
    outs = eng.generate(reqs, params)
    colocated = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    del eng
    print(f"colocated engine (2 threads): {colocated:.1f} output tok/s "
          f"({args.requests} requests, {args.prompt_len} in / {args.output_len} out)")

    init_local_ray(num_cpus=2)
    try:
        for backend in args.backends.split(","):
            cluster = Cluster(cluster_config(model, backend))
            cluster.start()
            try:
                print(f"\n== 1 prefill + 1 decode worker (1 thread each), transfer={backend}")

                tps = asyncio.run(_measure(cluster, reqs, params, args.repeats))
                print(f"   serving throughput: {tps:.1f} output tok/s = "
                      f"{tps / colocated:.2f}x the colocated engine", flush=True)
            finally:
                cluster.shutdown()
    finally:
        ray.shutdown()


async def _measure(cluster: Cluster, reqs: list[list[int]], params: SamplingParams,
                   repeats: int) -> float:
    router = cluster.make_router()
    await router.start()
    try:
        await _ttft(router, [128, 1024], repeats)
        return await _throughput(router, reqs, params)
    finally:
        await router.stop()


async def _ttft(router: Router, lengths: list[int], repeats: int) -> None:
    for length in lengths:
        finals = [await one(router, f"t{length}-{i}", p, SamplingParams(max_tokens=2))
                  for i, p in enumerate(prompts(repeats + 1, length, length))][1:]

        def mean_ms(xs: list[float | None]) -> float:
            return 1e3 * statistics.fmean(x for x in xs if x is not None)

        t = [f.timings for f in finals]
        ttft, xfer = mean_ms([x.ttft for x in t]), mean_ms([x.kv_transfer for x in t])
        print(f"   prompt {length:>5}: TTFT {ttft:7.1f} ms = router queue "
              f"{mean_ms([x.router_queue for x in t]):5.1f} + prefill queue "
              f"{mean_ms([x.prefill_queue for x in t]):5.1f} + prefill "
              f"{mean_ms([x.prefill for x in t]):7.1f} + transfer {xfer:6.1f} ms (+ hops); "
              f"transfer share {xfer / ttft:.1%}", flush=True)


async def _throughput(router: Router, reqs: list[list[int]], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    finals = await asyncio.gather(*(one(router, f"x{i}", p, params) for i, p in enumerate(reqs)))
    return sum(f.usage.completion_tokens for f in finals) / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
