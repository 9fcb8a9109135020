"""``make bench`` for speculative decoding (n-gram prompt lookup, suffix decoding,
and the model's own int4 copy as draft model), on the default model, greedy chat
prompts, against the same engine or server without speculation measured in the same
run.

1. Engine (colocated engines in this process, one per setting): per workload,
   single-stream TPOT (first token to last / tokens after the first) without and with
   each proposer setting, every prompt run on each engine in turn for ``--repeats``
   rounds (this machine drifts over minutes: interleaved, the ratio is one sitting's),
   the ratio, acceptance (accepted / draft tokens), tokens per verifying
   step, and whether the tokens are the same; then output tokens/s at 1..32
   concurrent streams under sustained load (a finished request replaced at once, as
   on a server) with and without speculation (where it stops paying:
   ``disable_by_batch_size``), and at each of those batch sizes the time of a step
   verifying 4 drafted tokens per request against a plain step's, and the acceptance
   at which drafting breaks even there (``verification_cost``).
2. Served (``pdserve serve``, colocated on 2 threads and 1P+1D, each worker's threads
   on both cores, through the HTTP chat endpoint as a client sees it): single-stream TPOT and text
   with and without ``--speculative-config`` (1P+1D: ngram, and the int4 copy as
   draft, both pools loading it); with ``--llama-server PATH``, llama.cpp's
   server on the same GGUF and prompts, without and with its n-gram speculation
   (``ngram-simple`` as it comes, and ``ngram-mod``), against pdserve in bf16 and with
   an int4 decode pool (the GGUF's own Q4_1 blocks, the weights llama-server runs).
   The servers compared run side by side (a pdserve server and its speculating twin,
   with llama-server + ``ngram-mod`` beside every pair, started anew each round: its
   n-grams outlive a request and would learn the same prompts' earlier answers), every
   prompt on each in turn for ``--repeats`` rounds: one server after another, this
   VM's drift (up to 4x between runs minutes apart) decided the ratios.

3. Draft rules at temperature 0.8, top-p 0.9, top-k 50 (no server, no engine: the
   target's and a draft's full distributions over the default model's own sampled
   answers to the open questions, through transformers): the expected acceptance per
   draft token of a greedy draft (the draft's argmax, accepted with the target's
   probability of it), of the probability-ratio rule (sum of min(p, q)), and of
   pdserve's draft sampled with the draws verification makes next (the overlap of
   the two inverse-CDF intervals of each token). Drafts: the model in bfloat16 (a
   close draft) and its first 24 and 20 of 30 layers (distant ones).

4. Predicted outputs (OpenAI's ``prediction``): renaming a function in a snippet and
   correcting a paragraph's spelling, the prediction the text given, and an open
   question with an unrelated prediction; TPOT with and without the prediction on an
   engine that does not speculate otherwise and on an ngram one, in turn for
   ``--repeats`` rounds, the drafted tokens accepted and rejected, the same tokens.

Workloads: *copy* (repeat a paragraph, copy a list adding numbers, repeat a code
snippet) and *open* (open-ended questions: nothing to copy).

Run: ``python -m benchmarks.spec [--parts 1,2,3,4] [--threads 2]
[--max-tokens 160] [--llama-server PATH] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.harness import Served
from pdserve.client.openai_stream import CHAT_COMPLETIONS, OpenAIStreamClient
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model.gguf_convert import default_gguf_path, resolve_model
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.spec.spec_decode import SuffixCache
from pdserve.engine.tokenizer import Tokenizer

PARAGRAPH = (
    "The lighthouse stood at the edge of the northern cliffs for more than two hundred "
    "years. Every evening the keeper climbed its one hundred and twelve steps, trimmed the "
    "wick, polished the great lens and watched the ships pass safely through the narrow "
    "channel below. When the storms came in winter, the light was the only thing the "
    "sailors could see, and many of them owed their lives to its steady beam.")
SHOPPING = ("apples\nbread\nmilk\neggs\nbutter\ncheese\ntomatoes\nonions\nrice\npasta\n"
            "olive oil\ncoffee")
CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result'''
WORKLOADS: dict[str, list[str]] = {
    "copy": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Copy this shopping list, one item per line, numbering the items:\n\n{SHOPPING}",
        f"Repeat this Python function exactly as it is:\n\n```python\n{CODE}\n```",
    ],
    "open": [
        "What are three good habits for staying healthy? Explain each one.",
        "Write a short story about a robot who learns to paint.",
        "Explain how rainbows form.",
    ],
}
PROPOSERS: dict[str, dict[str, Any]] = {
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
    "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 2},
}
TYPOS = ("The comittee met on Tuesday to discus the new budjet. After a long debate, the "
         "members agreed to increse funding for the library and to reduse spending on travel.")
# Predicted outputs (OpenAI's ``prediction``): (task, prompt, prediction).
PREDICTED: list[tuple[str, str, str]] = [
    ("rename in code", "Rename the function merge_sorted to merge everywhere in this code. "
     f"Reply with the whole code only.\n\n```python\n{CODE}\n```", f"```python\n{CODE}\n```"),
    ("fix spelling", "Correct the spelling mistakes in this paragraph. Reply with the corrected "
     f"paragraph only.\n\n{TYPOS}", TYPOS),
    ("unrelated", WORKLOADS["open"][2], CODE),
]
SERVED_SPEC = PROPOSERS["ngram k=8"]
SELF_DRAFT = "int4 draft k=6"


def self_draft(model: Path | str) -> dict[str, Any]:
    """The model drafted by its own int4 copy (for the default model, its GGUF's Q4_1
    blocks): a draft of any bf16 model, close enough that most guesses are accepted."""
    return {"method": "draft_model", "model": str(model), "quantization": "int4",
            "num_speculative_tokens": 6}
SERVED_MODEL = "SmolLM2-135M-Instruct"
WARM_UP = "Say hello in one sentence."  # a server's first request (not a measured prompt)


def single_stream(eng: LLMEngine, prompt: list[int], max_tokens: int,
                  prediction: tuple[int, ...] = ()) -> tuple[list[int], float]:
    """Tokens and TPOT (s) of one greedy request alone on ``eng``."""
    eng.add_request("bench", prompt, SamplingParams(max_tokens=max_tokens, prediction=prediction))
    tokens: list[int] = []
    first = last = 0.0
    while eng.has_unfinished():
        for out in eng.step().outputs:
            if out.new_token_ids:
                last = time.perf_counter()
                if not tokens:
                    first = last
                tokens.extend(out.new_token_ids)
    return tokens, (last - first) / max(1, len(tokens) - 1)


def part1(model: Path, tok: Tokenizer, threads: int, max_tokens: int,
          concurrency: list[int], repeats: int) -> dict[str, Any]:
    prompts = {w: [tok.apply_chat_template([{"role": "user", "content": p}]) for p in ps]
               for w, ps in WORKLOADS.items()}
    configs: dict[str, dict[str, Any] | None] = {"none": None, **PROPOSERS,
                                                 SELF_DRAFT: self_draft(model)}
    result: dict[str, Any] = {"single_stream": {}, "throughput": {}}
    print(f"\n1. engine, {threads} thread(s), greedy, max_tokens {max_tokens}, "
          f"{repeats} round(s), every prompt on every engine in turn")
    print(f"   {'workload':8} {'proposer':14} {'TPOT ms':>8} {'vs none':>8} {'accept':>7} "
          f"{'tok/step':>8}  same tokens")
    engines = {name: LLMEngine(model, EngineConfig(dtype="auto", num_threads=threads,
                                                   speculative_config=spec), tokenizer=tok)  # type: ignore[arg-type]
               for name, spec in configs.items()}
    for eng in engines.values():
        single_stream(eng, prompts["open"][0], 8)  # warm-up
    # Per workload and engine: tokens, seconds after the first token, and speculation
    # counters, summed over rounds in which every prompt runs on every engine in turn,
    # so that this machine's drift (minutes long) falls on all of them alike.
    runs: dict[tuple[str, str], list[tuple[list[int], float]]] = {}
    counts: dict[tuple[str, str], list[int]] = {}  # drafts, draft tokens, accepted
    for _ in range(repeats):
        for eng in engines.values():  # suffix: each round from an empty cache, as the
            cache = eng.suffix_cache  # first (else it drafts the last round's answers)
            if cache is not None:
                eng.suffix_cache = SuffixCache(cache.capacity, cache.min_n, cache.max_n)
        for workload, ps in prompts.items():
            for p in ps:
                for name, eng in engines.items():
                    before = eng.stats().spec
                    tokens, tpot = single_stream(eng, p, max_tokens)
                    runs.setdefault((workload, name), []).append((tokens, tpot))
                    after = eng.stats().spec
                    if before is not None and after is not None:
                        got = counts.setdefault((workload, name), [0, 0, 0])
                        got[0] += after.num_drafts - before.num_drafts
                        got[1] += after.num_draft_tokens - before.num_draft_tokens
                        got[2] += after.num_accepted_tokens - before.num_accepted_tokens
    for name in configs:
        for workload in prompts:
            rs = runs[(workload, name)]
            tpot = sum(t * (len(ts) - 1) for ts, t in rs) / sum(len(ts) - 1 for ts, _ in rs)
            row: dict[str, Any] = {"tpot_ms": tpot * 1e3}
            result["single_stream"].setdefault(workload, {})[name] = row
            if name == "none":
                print(f"   {workload:8} {name:14} {tpot * 1e3:8.2f}")
                continue
            drafts, drafted, accepted = counts[(workload, name)]
            none_tpot = result["single_stream"][workload]["none"]["tpot_ms"]
            row.update(speedup=none_tpot / row["tpot_ms"],
                       acceptance=accepted / drafted if drafted else 0.0,
                       tokens_per_step=1 + accepted / drafts if drafts else 1.0,
                       same_tokens=[ts for ts, _ in rs] ==
                       [ts for ts, _ in runs[(workload, "none")]])
            print(f"   {workload:8} {name:14} {row['tpot_ms']:8.2f} {row['speedup']:7.2f}x "
                  f"{row['acceptance']:7.0%} {row['tokens_per_step']:8.2f}  {row['same_tokens']}")
    del engines
    mixed = [p for ps in prompts.values() for p in ps]
    print(f"   output tokens/s by concurrent streams (mixed workload, max_tokens {max_tokens}, "
          f"sustained: a finished request replaced at once; best of {repeats}):")
    throughput_configs: dict[str, dict[str, Any] | None] = {
        "none": None, "ngram k=4": PROPOSERS["ngram k=4"],
        "ngram k=4, any batch": {**PROPOSERS["ngram k=4"], "disable_by_batch_size": 64},
        SELF_DRAFT: self_draft(model)}
    engines = {name: LLMEngine(model, EngineConfig(dtype="auto", num_threads=threads,
                                                   speculative_config=spec), tokenizer=tok)  # type: ignore[arg-type]
               for name, spec in throughput_configs.items()}
    best: dict[str, dict[int, float]] = {name: {} for name in engines}
    params = SamplingParams(max_tokens=max_tokens)
    for _ in range(repeats):  # interleaved, best of: this machine's noise is ~15%
        for name, eng in engines.items():
            eng.generate(mixed[:2], SamplingParams(max_tokens=4))
            for c in concurrency:
                total = len(mixed) * -(-2 * c // len(mixed))  # >= 2c, whole workloads
                best[name][c] = max(best[name].get(c, 0.0),
                                    sustained_load(eng, mixed, c, total, params).rate)
    for name, rates in best.items():
        result["throughput"][name] = rates
        print(f"   {name:28} " + "  ".join(f"c={c}: {r:6.1f}" for c, r in rates.items()))
    for name in list(throughput_configs)[1:]:
        ratios = {c: result["throughput"][name][c] / result["throughput"]["none"][c]
                  for c in concurrency}
        result["throughput"][f"{name} / none"] = ratios
        print(f"   {name + ' / none':28} " +
              "  ".join(f"c={c}: {r:5.2f}x" for c, r in ratios.items()))
    del engines
    result["verification_cost"] = verification_cost(model, tok, threads, concurrency, 4,
                                                    mixed, repeats)
    return result


@dataclass(frozen=True)
class Sustained:
    """What ``sustained_load`` counted: output tokens, seconds and steps while every
    step had the full number of requests in flight, and the requests that finished then."""

    tokens: int
    seconds: float
    steps: int
    finished: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def sustained_load(eng: LLMEngine, prompts: list[list[int]], streams: int, total: int,
                   params: SamplingParams) -> Sustained:
    """Output tokens/s of ``eng`` with ``streams`` requests in flight: ``total``
    requests (``prompts`` in turn), the next joining as soon as one finishes, counted
    until a step would run with fewer (nothing left to join); those left are aborted.

    Not a closed batch (``generate`` of ``streams`` requests): there the requests that
    cannot draft set the makespan, so a run takes as many steps with speculation as
    without however many drafts the others had accepted. Under sustained load a
    request that finishes early makes room for the next, as on a server."""
    pending = [(f"load-{i}", prompts[i % len(prompts)]) for i in range(total)][::-1]
    running: set[str] = set()
    tokens = steps = finished = 0
    t0 = time.perf_counter()
    while True:
        while pending and len(running) < streams:
            rid, prompt = pending.pop()
            eng.add_request(rid, prompt, params)
            running.add(rid)
        if len(running) < streams:
            break
        for out in eng.step().outputs:
            tokens += len(out.new_token_ids)
            if out.finished:
                running.discard(out.request_id)
                finished += 1
        steps += 1
    seconds = time.perf_counter() - t0
    for rid in running:
        eng.abort(rid)
    return Sustained(tokens, seconds, steps, finished)


def decode_step_seconds(eng: LLMEngine, prompts: list[list[int]],
                        params: list[SamplingParams],
                        rows: int) -> tuple[list[float], list[list[int]]]:
    """Run ``prompts`` to the end on ``eng``: the seconds of each step that computed
    exactly ``rows`` rows for all of them (decode steps, verifying drafts or not), and
    each prompt's output tokens."""
    outputs: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"cost-{i}", p, sp)
        outputs[f"cost-{i}"] = []
    seconds = []
    while eng.has_unfinished():
        step = eng.step()
        for out in step.outputs:
            outputs[out.request_id] += out.new_token_ids
        info = step.info
        if info is not None and info.num_seqs == len(prompts) and info.num_tokens == rows:
            seconds.append(info.seconds)
    return seconds, list(outputs.values())


def verification_cost(model: Path, tok: Tokenizer, threads: int, batch_sizes: list[int],
                      k: int, prompts: list[list[int]], repeats: int) -> dict[int, dict[str, float]]:
    """Where drafting stops paying on this machine, without a workload's noise: per
    batch size, the median time of a plain decode step and of a step verifying ``k``
    drafted tokens per request (each request's prediction is its own output, so every
    draft is accepted and every verifying step has ``batch x (k + 1)`` rows), and the
    acceptance at which drafting breaks even: a step verifying drafts makes
    ``1 + a k`` tokens per request where a plain one makes 1, so it pays while the
    acceptance ``a`` exceeds ``(t_verify / t_plain - 1) / k``."""
    print(f"   verification cost (decode steps, {k} drafted tokens per request, all accepted; "
          f"median of {repeats} round(s)):")
    plain = LLMEngine(model, EngineConfig(dtype="auto", num_threads=threads), tokenizer=tok)
    spec = {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": 1 << 20}
    verifying = LLMEngine(model, EngineConfig(dtype="auto", num_threads=threads,
                                              speculative_config=spec), tokenizer=tok)  # type: ignore[arg-type]
    base = SamplingParams(max_tokens=12 * (k + 1) + 1, ignore_eos=True)
    times: dict[int, tuple[list[float], list[float]]] = {b: ([], []) for b in batch_sizes}
    for _ in range(repeats):  # interleaved: this machine drifts
        for b in batch_sizes:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            seconds, outs = decode_step_seconds(plain, batch, [base] * b, b)
            times[b][0].extend(seconds)
            predicted = [replace(base, prediction=tuple(o)) for o in outs]  # all accepted
            times[b][1].extend(decode_step_seconds(verifying, batch, predicted, b * (k + 1))[0])
    result: dict[int, dict[str, float]] = {}
    print(f"   {'batch':>5} {'plain ms':>9} {'verify ms':>10} {'ratio':>6}  break-even acceptance")
    for b, (t_plain, t_verify) in times.items():
        plain_s, verify_s = statistics.median(t_plain), statistics.median(t_verify)
        ratio = verify_s / plain_s
        result[b] = {"plain_ms": plain_s * 1e3, "verify_ms": verify_s * 1e3, "ratio": ratio,
                     "break_even_acceptance": (ratio - 1) / k}
        print(f"   {b:5} {plain_s * 1e3:9.2f} {verify_s * 1e3:10.2f} {ratio:6.2f}  "
              f"{(ratio - 1) / k:.0%}")
    return result


def part4(model: Path, tok: Tokenizer, threads: int, max_tokens: int,
          repeats: int) -> dict[str, Any]:
    """Predicted outputs: each task with and without its prediction (tokenized as the
    router does), on an engine that does not speculate otherwise and on an ngram one."""
    engines = {name: LLMEngine(model, EngineConfig(dtype="auto", num_threads=threads,
                                                   speculative_config=spec), tokenizer=tok)  # type: ignore[arg-type]
               for name, spec in (("no speculation", None), ("ngram k=8", SERVED_SPEC))}
    tasks = [(name, tok.apply_chat_template([{"role": "user", "content": prompt}]),
              tuple(tok.encode(prediction, add_special_tokens=False)))
             for name, prompt, prediction in PREDICTED]
    print(f"\n4. predicted outputs, engine, {threads} thread(s), greedy, max_tokens "
          f"{max_tokens}, {repeats} round(s), with and without the prediction in turn")
    print(f"   {'task':16} {'engine':16} {'TPOT ms':>8} {'with':>8} {'ratio':>7} "
          f"{'accepted':>9} {'rejected':>9}  same tokens")
    for eng in engines.values():
        single_stream(eng, tasks[0][1], 8)  # warm-up
    # (task, engine, with prediction) -> tokens of each round, seconds after the first
    runs: dict[tuple[str, str, bool], list[tuple[list[int], float]]] = {}
    counts: dict[tuple[str, str], list[int]] = {}  # draft tokens, accepted (predicted)
    for r in range(repeats):
        for task, prompt, prediction in tasks:
            for name, eng in engines.items():
                for use in ((False, True) if r % 2 == 0 else (True, False)):
                    before = eng.stats().spec
                    runs.setdefault((task, name, use), []).append(single_stream(
                        eng, prompt, max_tokens, prediction if use else ()))
                    after = eng.stats().spec
                    if use and after is not None:
                        got = counts.setdefault((task, name), [0, 0])
                        got[0] += after.num_draft_tokens - (before.num_draft_tokens if before else 0)
                        got[1] += after.num_accepted_tokens - (
                            before.num_accepted_tokens if before else 0)
    result: dict[str, Any] = {}
    for task, _, _ in tasks:
        for name in engines:
            tpot = {}
            for use in (False, True):
                rs = runs[(task, name, use)]
                tpot[use] = sum(t * (len(ts) - 1) for ts, t in rs) / max(
                    1, sum(len(ts) - 1 for ts, _ in rs))
            drafted, accepted = counts.get((task, name), [0, 0])
            same = runs[(task, name, True)][0][0] == runs[(task, name, False)][0][0]
            row = {"tpot_ms": tpot[False] * 1e3, "tpot_with_ms": tpot[True] * 1e3,
                   "speedup": tpot[False] / tpot[True], "accepted": accepted,
                   "rejected": drafted - accepted, "same_tokens": same}
            result.setdefault(task, {})[name] = row
            print(f"   {task:16} {name:16} {row['tpot_ms']:8.2f} {row['tpot_with_ms']:8.2f} "
                  f"{row['speedup']:6.2f}x {accepted:9d} {drafted - accepted:9d}  {same}")
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    port = _free_port()
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


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}


def _processed(logits: Any) -> Any:
    """The sampler's distribution at ``SAMPLED`` (temperature, top-k, then top-p)."""
    import torch

    top, idx = (logits.float() / SAMPLED["temperature"]).topk(SAMPLED["top_k"], dim=-1)
    p = top.softmax(dim=-1)
    p = torch.where(p.cumsum(dim=-1) - p < SAMPLED["top_p"], p, 0.0)
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(
        -1, idx, p / p.sum(dim=-1, keepdim=True))


def part3(model: Path, tok: Tokenizer, max_tokens: int) -> dict[str, Any]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    answers = []
    for question in WORKLOADS["open"]:
        ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": question}])])
        out = target.generate(ids, max_new_tokens=max_tokens, do_sample=True, **SAMPLED)
        answers.append((out, ids.shape[1]))

    def first_layers(n: int) -> Any:
        m = copy.deepcopy(target)
        m.model.layers = m.model.layers[:n]
        m.config.num_hidden_layers = n
        return m

    drafts = {"bf16 copy": copy.deepcopy(target).to(torch.bfloat16),
              "24 of 30 layers": first_layers(24), "20 of 30 layers": first_layers(20)}
    print(f"\n3. draft rules: expected acceptance per draft token at {SAMPLED} over "
          f"{sum(a.shape[1] - n for a, n in answers)} answer tokens")
    print(f"   {'draft':16} {'greedy draft':>12} {'ratio rule':>11} {'shared draws':>13}")
    result: dict[str, Any] = {}
    with torch.no_grad():
        for name, draft in drafts.items():
            sums, n = [0.0, 0.0, 0.0], 0
            for ids, start in answers:
                p = _processed(target(ids).logits[0, start - 1 : -1])
                q = _processed(draft(ids).logits[0, start - 1 : -1])
                sums[0] += float(p.gather(-1, q.argmax(dim=-1, keepdim=True)).sum())
                sums[1] += float(torch.minimum(p, q).sum())
                cp, cq = p.double().cumsum(dim=-1), q.double().cumsum(dim=-1)
                lo = torch.maximum(cp - p.double(), cq - q.double())
                sums[2] += float((torch.minimum(cp, cq) - lo).clamp(min=0).sum())
                n += p.shape[0]
            row = dict(zip(("greedy_draft", "ratio_rule", "shared_draws"),
                           (x / n for x in sums), strict=True))
            result[name] = row
            print(f"   {name:16} {row['greedy_draft']:12.3f} {row['ratio_rule']:11.3f} "
                  f"{row['shared_draws']:13.3f}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--parts", default="1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", default="1,2,4,8,32")
    ap.add_argument("--repeats", type=int, default=3,
                    help="single-stream rounds (summed; engines and servers) and throughput runs "
                         "per point (best)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama.cpp's llama-server binary, to compare against (default: "
                         "$LLAMA_SERVER; skipped when unset)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    model = resolve_model(args.model)
    tok = Tokenizer.from_dir(model)
    report: dict[str, Any] = {"model": model.name, "threads": args.threads}
    if 1 in parts:
        report["engine"] = part1(model, tok, args.threads, args.max_tokens,
                                 [int(c) for c in args.concurrency.split(",")], args.repeats)
    if 2 in parts:
        report["served"] = part2(args.threads, args.max_tokens, args.llama_server,
                                 args.repeats)
    if 3 in parts:
        report["draft_rules"] = part3(model, tok, args.max_tokens)
    if 4 in parts:
        report["predicted"] = part4(model, tok, args.threads, args.max_tokens, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
