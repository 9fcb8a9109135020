"""``python -m benchmarks.spec`` part 2 (benchmarks/spec.py): ``pdserve serve`` with and
without speculation through the HTTP chat endpoint, and llama.cpp's llama-server on
the same GGUF, side by side, every prompt on each in turn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.harness import Served, free_port
from benchmarks.spec_workloads import (
    SELF_DRAFT,
    SERVED_MODEL,
    SERVED_SPEC,
    WARM_UP,
    WORKLOADS,
    self_draft,
)
from pdserve.client.openai_stream import CHAT_COMPLETIONS, OpenAIStreamClient
from pdserve.engine.model.gguf_convert import default_gguf_path


async def _chat_once(base_url: str, prompt: str, max_tokens: int,
                     model: str) -> tuple[str, float, int]:
    """One prompt through the chat endpoint: its text, the seconds from its first token
    to its last and the tokens after the first."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    # a connection per request: llama-server closes a streamed one after it
    async with OpenAIStreamClient(base_url) as client:
        out = await client.stream(CHAT_COMPLETIONS, body)
    if not out.success:
        raise RuntimeError(f"request to {base_url} failed: {out.error}")
    return out.generated_text, out.latency - out.ttft, out.output_tokens - 1


def _interleaved(servers: dict[str, tuple[str, str]], max_tokens: int, repeats: int,
                 fresh: Mapping[str, Callable[[], AbstractContextManager[tuple[str, str]]]],
                 ) -> dict[str, dict[str, tuple[list[str], float]]]:
    """Single-stream TPOT of each server (name -> (base URL, model)) per workload: every
    prompt on each server in turn (the order alternating), ``repeats`` rounds, time and
    tokens summed, so that the machine's drift over minutes falls on all of them alike.
    ``fresh``: servers started anew for each round (name -> what starts one), whose
    drafts would otherwise learn the earlier rounds' answers to the same prompts
    (llama-server's ngram-mod keeps its n-grams across requests). Texts are the first
    round's (greedy)."""
    names = [*servers, *fresh]
    for url, model in servers.values():
        asyncio.run(_chat_once(url, WARM_UP, max_tokens, model))
    spent = {n: {w: 0.0 for w in WORKLOADS} for n in names}
    counted = {n: {w: 0 for w in WORKLOADS} for n in names}
    texts: dict[str, dict[str, list[str]]] = {n: {w: [] for w in WORKLOADS} for n in names}
    turn = 0
    for r in range(repeats):
        with contextlib.ExitStack() as started:
            running = dict(servers)
            for name, start in fresh.items():
                running[name] = started.enter_context(start())
                url, model = running[name]
                asyncio.run(_chat_once(url, WARM_UP, max_tokens, model))
            for w, prompts in WORKLOADS.items():
                for prompt in prompts:
                    turn += 1
                    for name in names if turn % 2 else names[::-1]:
                        url, model = running[name]
                        text, sec, n = asyncio.run(_chat_once(url, prompt, max_tokens, model))
                        spent[name][w] += sec
                        counted[name][w] += n
                        if r == 0:
                            texts[name][w].append(text)
    return {n: {w: (texts[n][w], spent[n][w] / max(1, counted[n][w])) for w in WORKLOADS}
            for n in names}


def _ended(proc: subprocess.Popen[bytes]) -> str:
    """How a child process ended, or that it is still running."""
    code = proc.poll()
    if code is None:
        return "still running after 120 s"
    if code < 0:  # a native build for instructions this CPU lacks dies with SIGILL
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@contextlib.contextmanager
def _llama_server(binary: str, gguf: Path, threads: int,
                  spec_flags: list[str]) -> Iterator[tuple[str, str]]:
    """llama.cpp's server on ``gguf`` while the block runs: (its base URL, model)."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="pdserve-llama-")) / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port",
                                 str(port), "-t", str(threads), "-c", "4096", *spec_flags],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while b"listening on" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start ({_ended(proc)}):\n"
                                   f"{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", "x"
    finally:
        proc.terminate()
        proc.wait(30)


def part2(threads: int, max_tokens: int, llama_server: str | None,
          repeats: int) -> dict[str, Any]:
    spec = json.loads(json.dumps(SERVED_SPEC))
    colocated = {"prefill": {"workers": 0}, "decode": {"workers": 0},
                 "colocated": {"workers": 1, "num_cpus": threads}}
    pair = {"prefill": {"num_cpus": 1}, "decode": {"num_cpus": 1}}
    configs: dict[str, dict[str, Any]] = {
        "pdserve colocated": colocated,
        "pdserve colocated + ngram": {**colocated, "colocated": {
            **colocated["colocated"], "engine": {"speculative_config": spec}}},
        "pdserve 1P+1D": pair,
        "pdserve 1P+1D + ngram": {**pair, "decode": {"num_cpus": 1, "engine": {
            "speculative_config": spec}}},
        # both pools: the prefill worker makes the draft's prompt KV
        f"pdserve 1P+1D + {SELF_DRAFT}": {pool: {"num_cpus": 1, "engine": {
            "speculative_config": self_draft(SERVED_MODEL)}} for pool in ("prefill", "decode")},
        # int4 decode: the GGUF's own Q4_1 blocks, the weights llama-server runs
        "pdserve 1P+1D int4": {**pair, "decode": {"num_cpus": 1, "engine": {
            "quantization": "int4"}}},
        "pdserve 1P+1D int4 + ngram": {**pair, "decode": {"num_cpus": 1, "engine": {
            "quantization": "int4", "speculative_config": spec}}},
    }
    # Each server runs beside the one it is compared with, a prompt on each in turn;
    # llama-server with ngram-mod (the faster of its n-gram types on this workload,
    # measured) beside every pair, started anew each round, so that each comparison is
    # one sitting's.
    print(f"\n2. served, single stream, chat, greedy, max_tokens {max_tokens}, {repeats} "
          f"round(s), every prompt on each server of a group in turn (client TPOT: first "
          f"token to last / tokens after the first)", flush=True)
    results: dict[str, dict[str, tuple[list[str], float]]] = {}
    versus: dict[str, dict[str, float]] = {}
    llama = None if not llama_server else partial(
        _llama_server, llama_server, default_gguf_path(), threads)
    mod = {} if llama is None else {"llama-server + ngram": partial(llama, ["--spec-type",
                                                                            "ngram-mod"])}
    # each base beside its speculating twins
    groups = {"pdserve colocated": ["+ ngram"],
              "pdserve 1P+1D": ["+ ngram", f"+ {SELF_DRAFT}"],
              "pdserve 1P+1D int4": ["+ ngram"]}
    for base, twins in groups.items():
        names = [base, *(f"{base} {t}" for t in twins)]
        with contextlib.ExitStack() as stack:
            urls = {n: stack.enter_context(Served(configs[n])).url for n in names}
            got = _interleaved({n: (url, SERVED_MODEL) for n, url in urls.items()},
                               max_tokens, repeats, mod)
        results.update({n: got[n] for n in names})
        if mod:
            ours = f"{base} + ngram"
            versus[ours] = {w: got["llama-server + ngram"][w][1] / got[ours][w][1]
                            for w in WORKLOADS}
    if llama is not None:
        with llama([]) as plain_url, llama(["--spec-type", "ngram-simple"]) as simple_url:
            results.update(_interleaved({"llama-server": plain_url,
                                         "llama-server + ngram-simple": simple_url},
                                        max_tokens, repeats, mod))
    out: dict[str, Any] = {}
    for name, res in results.items():
        row = {w: {"tpot_ms": tpot * 1e3} for w, (_, tpot) in res.items()}
        ref = name.split(" + ")[0]
        if ref != name:
            for w, (texts, tpot) in res.items():
                row[w]["speedup"] = results[ref][w][1] / tpot
                row[w]["same_text"] = texts == results[ref][w][0]
        out[name] = row
        print(f"   {name:34} " + "  ".join(
            f"{w}: {r['tpot_ms']:6.2f} ms" + (f" ({r['speedup']:.2f}x, same text "
                                              f"{r['same_text']})" if "speedup" in r else "")
            for w, r in row.items()))
    for ours, ratios in versus.items():
        out[f"{ours} vs llama-server + ngram-mod"] = ratios
        print(f"   {ours} vs llama-server + ngram-mod (TPOT ratio in the same rounds, > 1: "
              f"pdserve faster): " + "  ".join(f"{w} {r:.2f}x" for w, r in ratios.items()))
    return out
