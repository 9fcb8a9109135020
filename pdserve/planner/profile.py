"""The planner's measured step times: ``measure_profile`` runs a real engine on this
CPU (prefill steps over prompt lengths, decode steps over batch sizes and contexts)
and fits a ``planner.Profile`` to them (least squares with non-negative coefficients);
``validate`` compares that profile's predicted TTFT/TPOT with measured engine runs.

Apart from ``step_times.py`` so that sizing and the autoscale decision import no engine
(``pdserve plan`` on an analytic model stays light); this module imports the engine
on first use.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine import defaults
from pdserve.planner.step_times import CLOCKS, Profile, coef3

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


# ----------------------------------------------------------------- fitting
def _solve(a: list[list[float]], y: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (tiny dense systems)."""
    n = len(y)
    m = [row[:] + [y[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-10 * len(y):  # the caller scales columns to max 1
            raise ValueError("singular fit: too few distinct samples")
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                m[r] = [x - k * z for x, z in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_nonnegative(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares on relative error (weights 1/y²), with every coefficient >= 0:
    a term whose coefficient comes out negative is dropped and the rest refit (and the
    last term, while the samples cannot tell the terms apart)."""
    k = len(rows[0])
    active = list(range(k))
    # Rows divided by y (relative error, target 1), columns by their largest entry
    # (so the normal equations are well scaled and a tiny pivot means collinear).
    while active:
        x = [[r[j] / max(v, 1e-12) for j in active] for r, v in zip(rows, y, strict=True)]
        scale = [max(abs(row[p]) for row in x) or 1.0 for p in range(len(active))]
        x = [[row[p] / scale[p] for p in range(len(active))] for row in x]
        n = len(active)
        ata = [[sum(row[p] * row[q] for row in x) for q in range(n)] for p in range(n)]
        aty = [sum(row[p] for row in x) for p in range(n)]
        try:
            beta = [b / sc for b, sc in zip(_solve(ata, aty), scale, strict=True)]
        except ValueError:  # collinear columns (e.g. one decode context): drop the last
            del active[-1]
            continue
        worst = min(range(n), key=lambda p: beta[p])
        if beta[worst] >= 0 or n == 1:
            out = [0.0] * k
            for p, j in enumerate(active):
                out[j] = max(0.0, beta[p])
            return out
        del active[worst]
    return [0.0] * k


def _worst_error_pct(rows: Sequence[Sequence[float]], y: Sequence[float],
                     coef: Sequence[float]) -> float:
    return max(abs(sum(c * x for c, x in zip(coef, r, strict=True)) - v) / v * 100
               for r, v in zip(rows, y, strict=True))


# ----------------------------------------------------------- measurement
def _engine(model_dir: str | Path, dtype: str, quantization: str, threads: int,
            max_seqs: int, max_tokens: int, num_blocks: int | None) -> LLMEngine:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(model_dir, EngineConfig(
        dtype=dtype, quantization=quantization, num_threads=threads,
        enable_prefix_caching=False, max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, max_tokens), num_blocks=num_blocks),
        load_tokenizer=False)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(100, vocab // 2)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def _measure(eng: LLMEngine, prefill_lens: Sequence[int], decode_batches: Sequence[int],
             decode_contexts: Sequence[int], decode_steps: int, repeats: int,
             log: Callable[[str], None], clock: Callable[[], float]
             ) -> tuple[list[list[float]], list[list[float]]]:
    """(prefill samples [N, ms], decode samples [B, ctx, ms]) of step times on ``clock``."""
    from pdserve.engine.sampling.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.add_request("warm", _prompt(rng, min(prefill_lens), vocab), one)
    while eng.has_unfinished():
        eng.step()
    prefill: list[list[float]] = []
    for n in prefill_lens:
        times = []
        for r in range(repeats):
            eng.add_request(f"p{n}-{r}", _prompt(rng, n, vocab), one)
            t0 = clock()
            eng.step()
            times.append((clock() - t0) * 1e3)
            while eng.has_unfinished():  # a prompt longer than the step budget
                t0 = clock()
                eng.step()
                times[-1] += (clock() - t0) * 1e3
        prefill.append([float(n), statistics.median(times)])
        log(f"  prefill {n:>5} tokens: {prefill[-1][1]:8.2f} ms")
    decode: list[list[float]] = []
    params = SamplingParams(max_tokens=decode_steps + 3, ignore_eos=True)
    for c in decode_contexts:
        for b in decode_batches:
            # Reserved blocks + start_decode, as a decode worker does: the KV is not
            # computed (its values do not change the step's time).
            rids = [f"d{b}-{c}-{i}" for i in range(b)]
            for rid in rids:
                p = _prompt(rng, c, vocab)
                if eng.reserve(rid, p, params) is None:
                    raise ValueError(f"decode batch {b} x {c} tokens does not fit the KV cache")
                eng.start_decode(rid, p[-1])
            eng.step()  # warm-up
            times, ctx = [], []
            for _ in range(decode_steps):
                t0 = clock()
                out = eng.step()
                times.append((clock() - t0) * 1e3)
                assert out.info is not None and out.info.num_decode == b
                ctx.append(out.info.context_tokens / b)
            for rid in rids:
                eng.abort(rid)
            decode.append([float(b), statistics.fmean(ctx), statistics.median(times)])
            log(f"  decode batch {b:>3}, context {c:>5}: {decode[-1][2]:8.2f} ms/step")
    return prefill, decode


def _fit_profile(eng: LLMEngine, threads: int, prefill: list[list[float]],
                 decode: list[list[float]], seconds: float, clock: str) -> Profile:
    from pdserve.engine.config import EngineConfig

    p_rows = [[1.0, n, n * n] for n, _ in prefill]
    p_y = [ms for _, ms in prefill]
    d_rows = [[1.0, b, b * c] for b, c, _ in decode]
    d_y = [ms for _, _, ms in decode]
    pc = fit_nonnegative(p_rows, p_y)
    dc = fit_nonnegative(d_rows, d_y)
    mc = eng.model_config
    cfg = eng.config
    kv_bytes = (2 * mc.num_layers * mc.num_kv_heads * eng.kv_cache.shape[-1]
                * eng.kv_cache.element_size())  # a row (int8: with its scale)
    default_blocks = EngineConfig(dtype=cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype
                                  ).resolve_num_blocks(mc)
    return Profile(
        model=mc.name or eng.model_dir.name, device=cfg.device, dtype=cfg.dtype,
        quantization=cfg.quantization, threads=threads,
        prefill_coef=coef3(pc), decode_coef=coef3(dc), kv_bytes_per_token=kv_bytes,
        kv_tokens=default_blocks * cfg.block_size,
        samples={"prefill": prefill, "decode": decode},
        fit_error_pct={"prefill": round(_worst_error_pct(p_rows, p_y, pc), 2),
                       "decode": round(_worst_error_pct(d_rows, d_y, dc), 2)},
        measured_s=round(seconds, 2), clock=clock)


def _blocks_needed(prefill_lens: Sequence[int], decode_batches: Sequence[int],
                   decode_contexts: Sequence[int], decode_steps: int, block: int) -> int:
    per_seq = -(-(max(decode_contexts) + decode_steps + 4) // block)
    return max(max(decode_batches) * per_seq, -(-max(prefill_lens) // block) + 1) + 8


def measure_profile(model_dir: str | Path, *, dtype: str = "auto", quantization: str = "none",
                    threads: int = 1, prefill_lens: Sequence[int] = (32, 128, 256, 512),
                    decode_batches: Sequence[int] = (1, 4, 8, 16),
                    decode_contexts: Sequence[int] = (128, 512), decode_steps: int = 6,
                    repeats: int = 2, clock: str | None = None,
                    log: Callable[[str], None] | None = None) -> Profile:
    """Measure one CPU worker's engine step times and fit a ``Profile``: prefill steps
    of each prompt length (``repeats`` times, median), decode steps at each batch and
    context (``decode_steps`` each, median), timed on ``clock`` (``CLOCKS``; None: the
    CPU clock for one thread, the wall clock for more -- a process's CPU time adds its
    threads' up). Torch's thread count is restored after.
    About 15 s (model load included) for the default model on one thread."""
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if clock is None:
        clock = "cpu" if threads == 1 else "wall"
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if len(set(prefill_lens)) < 3 or len(set(decode_batches)) < 2 or not decode_contexts:
        raise ValueError("a profile needs >= 3 prefill lengths, >= 2 decode batch sizes "
                         "and a decode context")
    log = log or (lambda _: None)
    before = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        blocks = _blocks_needed(prefill_lens, decode_batches, decode_contexts, decode_steps,
                                defaults.BLOCK_SIZE)
        eng = _engine(model_dir, dtype, quantization, threads, max(decode_batches),
                      max(prefill_lens), blocks)
        prefill, decode = _measure(eng, prefill_lens, decode_batches, decode_contexts,
                                   decode_steps, repeats, log, CLOCKS[clock])
        return _fit_profile(eng, threads, prefill, decode, time.perf_counter() - t0, clock)
    finally:
        torch.set_num_threads(before)



# -------------------------------------------------------------- validation
VALIDATION_CONFIGS = (  # (label, prompt tokens, output tokens, concurrent streams)
    ("prompt 128 / out 64, 1 stream", 128, 64, 1),
    ("prompt 512 / out 32, 1 stream", 512, 32, 1),
    ("prompt 128 / out 64, batch 8", 128, 64, 8),
)


def _measured_run(eng: LLMEngine, n_in: int, n_out: int, streams: int,
                  seed: int) -> dict[str, tuple[float, float]]:
    """clock -> (mean TTFT ms, mean TPOT ms) of ``streams`` requests started together,
    on both ``CLOCKS``."""
    from pdserve.engine.sampling.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    t0 = {k: c() for k, c in CLOCKS.items()}
    first: dict[str, dict[str, float]] = {}
    last: dict[str, dict[str, float]] = {}
    for i in range(streams):
        eng.add_request(f"v{seed}-{i}", _prompt(rng, n_in, vocab), params)
    while eng.has_unfinished():
        outs = eng.step().outputs
        now = {k: c() for k, c in CLOCKS.items()}
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    return {k: (statistics.fmean((first[r][k] - t0[k]) * 1e3 for r in first),
                statistics.fmean((last[r][k] - first[r][k]) * 1e3 / (n_out - 1) for r in first))
            for k in CLOCKS}


def validate(model_dir: str | Path | None = None, threads: int = 1, repeats: int = 2,
             profile_out: str | Path | None = None, clock: str = "cpu") -> list[dict[str, Any]]:
    """Measure a profile on this CPU, then run each ``VALIDATION_CONFIGS`` entry on the
    same engine; print the profile's predicted TTFT and TPOT against the measured ones
    (errors on the profile's ``clock``; the wall-clock figures beside them)."""
    import torch

    from pdserve.engine.model.gguf_convert import resolve_model

    path = resolve_model(str(model_dir) if model_dir else None)
    before = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        lens, batches, ctxs, steps = (32, 128, 256, 512), (1, 4, 8, 16), (128, 512), 6
        eng = _engine(path, "auto", "none", threads, max(batches), 2048,
                      _blocks_needed(lens, batches, ctxs, steps, defaults.BLOCK_SIZE))
        print(f"measuring the profile of {path.name} ({threads} thread(s), {clock} clock) ...",
              flush=True)
        prefill, decode = _measure(eng, lens, batches, ctxs, steps, 2,
                                   lambda s: print(s, flush=True), CLOCKS[clock])
        prof = _fit_profile(eng, threads, prefill, decode, time.perf_counter() - t0, clock)
        if profile_out:
            prof.save(profile_out)
        rows = []
        for label, n_in, n_out, streams in VALIDATION_CONFIGS:
            runs = [_measured_run(eng, n_in, n_out, streams, seed) for seed in range(repeats)]
            meas = {k: (statistics.median(r[k][0] for r in runs),
                        statistics.median(r[k][1] for r in runs)) for k in CLOCKS}
            p_ttft = prof.prefill_step_ms(streams, n_in)
            p_tpot = prof.decode_ms(streams, n_in + n_out / 2)
            m_ttft, m_tpot = meas[clock]
            rows.append({"config": label, "ttft_pred_ms": p_ttft, "ttft_meas_ms": m_ttft,
                         "ttft_err_pct": (p_ttft - m_ttft) / m_ttft * 100,
                         "ttft_wall_ms": meas["wall"][0],
                         "tpot_pred_ms": p_tpot, "tpot_meas_ms": m_tpot,
                         "tpot_err_pct": (p_tpot - m_tpot) / m_tpot * 100,
                         "tpot_wall_ms": meas["wall"][1]})
    finally:
        torch.set_num_threads(before)
    print(f"\nprofile measured in {prof.measured_s:.1f} s; validation total "
          f"{time.perf_counter() - t0:.1f} s ({path.name}, {prof.dtype}, {threads} thread(s); "
          f"errors on the {clock} clock, wall clock in brackets)")
    head = (f"{'config':<30} {'TTFT pred':>9} {'measured':>9} {'err':>7} {'(wall)':>9}   "
            f"{'TPOT pred':>9} {'measured':>9} {'err':>7} {'(wall)':>9}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['config']:<30} {r['ttft_pred_ms']:>7.1f}ms {r['ttft_meas_ms']:>7.1f}ms "
              f"{r['ttft_err_pct']:>+6.1f}% {r['ttft_wall_ms']:>7.1f}ms   "
              f"{r['tpot_pred_ms']:>7.2f}ms {r['tpot_meas_ms']:>7.2f}ms "
              f"{r['tpot_err_pct']:>+6.1f}% {r['tpot_wall_ms']:>7.2f}ms")
    return rows

