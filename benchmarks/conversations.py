"""``make bench`` for KV that moves less: multi-turn chat through ``pdserve serve``
1P+1D, sent as chat clients send it (every turn resends the whole history): the
defaults (the decode worker's prefix reuse, and its own prefill of a next turn's
short uncached suffix) against every prompt block sent through the prefill worker
(as before issue 22), reuse without the local prefill, the defaults with int8 KV
caches on both pools, and a colocated worker as the reference for the answers.

Per run: KV bytes the prefill worker sent (its ``/metrics``), TTFT p50/p90 (client
side), output tokens/s; then the bytes ratio, the TTFT ratio and whether every
greedy answer equals the colocated worker's.

Then (``--mooncake N``, 0 to skip) N requests of the Mooncake conversation trace
replayed through 1P+1D with the defaults and with every block sent, lengths scaled so that one
of its 512-token hash blocks is one 16-token KV block: the KV bytes saved against the
window's own prefix reuse (the share of its prompts' blocks an earlier request of the
window already had).

Run: ``python -m benchmarks.conversations [--conversations 4] [--turns 8]
[--max-tokens 48] [--mooncake 200] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Served, metric
from benchmarks.serving import mooncake_window, trace_run
from pdserve.client.openai_stream import CHAT_COMPLETIONS, OpenAIStreamClient

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the ocean", "volcanoes", "the history of bread", "how bicycles work",
          "honey bees", "the moon", "paper making", "rainforests"]
FOLLOW_UPS = ["Tell me more.", "Why is that?", "Give me an example.", "What else?",
              "Explain it to a child.", "Summarise what you said.", "Any fun facts?"]


def opening(i: int) -> str:
    return f"Let's talk about {TOPICS[i % len(TOPICS)]}. What is the most interesting thing about it?"


async def conversation(base_url: str, i: int, turns: int,
                       max_tokens: int) -> list[tuple[str, float, int]]:
    """One conversation, turn by turn; (answer, TTFT, output tokens) per turn."""
    messages: list[dict[str, str]] = []
    out: list[tuple[str, float, int]] = []
    for t in range(turns):
        messages.append({"role": "user",
                         "content": opening(i) if t == 0 else FOLLOW_UPS[(i + t) % len(FOLLOW_UPS)]})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with OpenAIStreamClient(base_url) as client:
            res = await client.stream(CHAT_COMPLETIONS, body)
        if not res.success:
            raise RuntimeError(f"turn {t} of conversation {i} failed: {res.error}")
        out.append((res.generated_text, res.ttft, res.output_tokens))
        messages.append({"role": "assistant", "content": res.generated_text})
    return out


def run(config: dict[str, Any], conversations: int, turns: int,
        max_tokens: int) -> dict[str, Any]:
    with Served(config) as served:
        async def all_of_them() -> list[list[tuple[str, float, int]]]:
            return list(await asyncio.gather(*(conversation(served.url, i, turns, max_tokens)
                                               for i in range(conversations))))

        t0 = time.perf_counter()
        results = asyncio.run(all_of_them())
        wall = time.perf_counter() - t0
        sent = sent_bytes(served)
        reused = sum(metric(served.scrape(w), "pdserve_prefix_cache_hits_total")
                     for w in served.workers if w.startswith("decode"))
    ttfts = sorted(t for conv in results for _, t, _ in conv)
    return {"answers": [[a for a, _, _ in conv] for conv in results],
            "kv_bytes_sent": sent, "decode_blocks_reused": reused,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3,
            "output_tokens_per_s": sum(n for conv in results for _, _, n in conv) / wall}


def sent_bytes(served: Served) -> float:
    return sum(metric(served.scrape(w), "pdserve_kv_transfer_bytes_total")
               for w in served.workers if w.startswith("prefill"))


def window_reuse(trace: Path) -> float:
    """Of the window's prompt blocks (hash ids), the share whose whole prefix chain an
    earlier request of the window had: what a cache that forgets nothing reuses."""
    seen: set[tuple[int, ...]] = set()
    total = hits = 0
    for line in trace.read_text().splitlines():
        chain: tuple[int, ...] = ()
        hitting = True
        for h in json.loads(line)["hash_ids"]:
            chain += (h,)
            hitting = hitting and chain in seen
            hits += hitting
            total += 1
            seen.add(chain)
    return hits / max(1, total)


def mooncake(n: int, block_size: int = 16) -> dict[str, float]:
    """The trace window through 1P+1D, every block sent against the defaults (decode-side
    reuse, and the decode worker's own prefill of short uncached suffixes)."""
    trace = mooncake_window(n, rate=1.0, start=0)
    scale = block_size / 512  # a hash block = a KV block
    roomy: dict[str, Any] = {"kv_cache_bytes": 1 << 30}  # D keeps the whole window
    runs = {"every block sent": {"prefill": {"num_cpus": 1}, "decode": {
                "num_cpus": 1, "engine": {**roomy, "enable_prefix_caching": False}}},
            "defaults": {"prefill": {"num_cpus": 1},
                         "decode": {"num_cpus": 1, "engine": roomy}}}
    sent: dict[str, float] = {}
    for name, cfg in runs.items():
        with Served(cfg) as served:
            trace_run(served, trace, scale, n, "--max-concurrency", "4")
            sent[name] = sent_bytes(served)
    reuse = window_reuse(trace)
    saved = 1 - sent["defaults"] / max(1.0, sent["every block sent"])
    print(f"\nMooncake conversation trace, first {n} requests, lengths x{scale:g} (a hash "
          f"block = a {block_size}-token KV block), 1P+1D")
    for name, b in sent.items():
        print(f"   {name:20} {b / 1e6:8.1f} MB of KV sent")
    print(f"   bytes saved {saved:.1%}; the window's own prefix reuse {reuse:.1%}")
    return {**{f"kv_bytes_sent: {k}": v for k, v in sent.items()},
            "bytes_saved": saved, "window_reuse": reuse}


def chat(conversations: int, turns: int, max_tokens: int) -> dict[str, Any]:
    """The multi-turn chat runs (module docstring); their figures, answers left out."""
    pair = {"prefill": {"num_cpus": 1}, "decode": {"num_cpus": 1}}
    configs: dict[str, dict[str, Any]] = {
        "1P+1D, every block sent": {**pair, "decode": {
            "num_cpus": 1, "engine": {"enable_prefix_caching": False}}},
        "1P+1D, reuse, no local prefill": {**pair, "router": {"local_prefill_max_tokens": 0}},
        "1P+1D, defaults": pair,
        "1P+1D, defaults, int8 KV": {
            "prefill": {"num_cpus": 1, "engine": {"kv_cache_dtype": "int8"}},
            "decode": {"num_cpus": 1, "engine": {"kv_cache_dtype": "int8"}}},
        "colocated": {"prefill": {"workers": 0}, "decode": {"workers": 0},
                      "colocated": {"workers": 1, "num_cpus": 2}},
    }
    res = {name: run(cfg, conversations, turns, max_tokens)
           for name, cfg in configs.items()}
    new, old = res["1P+1D, defaults"], res["1P+1D, every block sent"]
    print(f"\n{conversations} conversations x {turns} turns, whole history resent "
          f"each turn, greedy, max_tokens {max_tokens}, default model")
    print(f"   {'run':28} {'KV sent MB':>10} {'blocks reused':>13} {'TTFT p50':>9} "
          f"{'TTFT p90':>9} {'out tok/s':>9}  answers = colocated")
    def same_turns(a: list[list[str]], b: list[list[str]]) -> str:
        """Turns whose answer is the same, up to the first that differs per conversation
        (after it the histories differ)."""
        equal = total = 0
        for ca, cb in zip(a, b, strict=True):
            total += len(ca)
            for x, y in zip(ca, cb, strict=True):
                if x != y:
                    break
                equal += 1
        return f"{equal}/{total}"

    for name, r in res.items():
        r["answers_equal_colocated"] = same_turns(r["answers"], res["colocated"]["answers"])
        print(f"   {name:28} {r['kv_bytes_sent'] / 1e6:10.1f} {r['decode_blocks_reused']:13.0f} "
              f"{r['ttft_p50_ms']:7.1f}ms {r['ttft_p90_ms']:7.1f}ms "
              f"{r['output_tokens_per_s']:9.1f}  {r['answers_equal_colocated']} turns")
    print(f"   1P+1D defaults vs every block sent, same answers: "
          f"{same_turns(new['answers'], old['answers'])} turns")
    ratio = new["kv_bytes_sent"] / max(1.0, old["kv_bytes_sent"])
    print(f"   KV bytes sent, defaults / every block sent: {ratio:.2f}x; TTFT p50 "
          f"{old['ttft_p50_ms'] / new['ttft_p50_ms']:.2f}x better; output tokens/s "
          f"{new['output_tokens_per_s'] / old['output_tokens_per_s']:.2f}x")
    r = res["1P+1D, reuse, no local prefill"]
    print(f"   reuse without the local prefill: TTFT p50 "
          f"{old['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x better than every block sent")
    q = res["1P+1D, defaults, int8 KV"]
    print(f"   int8 KV (with reuse) / every block sent: "
          f"{q['kv_bytes_sent'] / max(1.0, old['kv_bytes_sent']):.2f}x the bytes; TTFT p50 "
          f"{old['ttft_p50_ms'] / q['ttft_p50_ms']:.2f}x better")
    return {k: {kk: vv for kk, vv in v.items() if kk != "answers"} for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4, help="0: no chat runs")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--mooncake", type=int, default=200,
                    help="requests of the Mooncake conversation trace replayed (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    if args.conversations:
        out = chat(args.conversations, args.turns, args.max_tokens)
    if args.mooncake:
        out["mooncake"] = mooncake(args.mooncake)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
