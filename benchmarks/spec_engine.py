"""``python -m benchmarks.spec`` parts 1 and 4 (benchmarks/spec.py): speculating engines
in this process -- single-stream TPOT per proposer and workload, throughput under
sustained load, what verifying a draft costs per batch size; predicted outputs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.spec_workloads import (
    PREDICTED,
    PROPOSERS,
    SELF_DRAFT,
    SERVED_SPEC,
    WORKLOADS,
    self_draft,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.spec.spec_decode import SuffixCache
from pdserve.engine.tokenizer import Tokenizer


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
