"""PNG figures of a benchmark (matplotlib, Agg backend: no display needed).

This module owns three figures, each drawn from result JSON objects (so a saved
result can be plotted again later):

* ``latency_cdf.png`` — CDFs of TTFT, TPOT and ITL, one curve per run (per rate
  in a sweep);
* ``timeline.png`` (``timeline_<rate>.png`` in a sweep) — one horizontal line per
  request: waiting for the first token (start -> first token) and decoding
  (first token -> end); failed requests drawn in red;
* ``sweep.png`` — SLO attainment against request rate, with the attainment target
  and the DistServe goodput marked (``sweep.distserve_goodput``), and vLLM's
  per-run goodput / throughput against request rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    return plt


def request_tpots_ms(result: Mapping[str, Any]) -> list[float]:
    """Per completed request with >= 2 output tokens: (e2el - ttft) / (tokens - 1), ms."""
    return [(lat - ttft) / (n - 1) * 1000.0
            for lat, ttft, n, err in zip(result["latencies"], result["ttfts"],
                                         result["output_lens"], result["errors"], strict=True)
            if not err and n >= 2]


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=np.float64))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(runs: Sequence[tuple[str, Mapping[str, Any]]], path: str | Path) -> Path:
    """CDFs of TTFT, TPOT, ITL (ms) for each (label, result) in `runs`."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, result in runs:
        ok = [not e for e in result["errors"]]
        _cdf(axes[0], [t * 1000.0 for t, good in zip(result["ttfts"], ok, strict=True)
                       if good], label)
        _cdf(axes[1], request_tpots_ms(result), label)
        _cdf(axes[2], [g * 1000.0 for gaps in result["itls"] for g in gaps], label)
    for ax, title in zip(axes, ("TTFT", "TPOT (excl. 1st token)", "ITL"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_timeline(result: Mapping[str, Any], path: str | Path) -> Path:
    """Per request: start -> first token (orange), first token -> end (blue)."""
    plt = _pyplot()
    starts = result["start_times"]
    n = len(starts)
    fig, ax = plt.subplots(figsize=(12, max(3.0, min(12.0, 0.06 * n + 2))))
    for i, (start, ttft, lat, err) in enumerate(zip(starts, result["ttfts"],
                                                    result["latencies"], result["errors"],
                                                    strict=True)):
        if err:
            ax.plot([start, start], [i - 0.4, i + 0.4], color="red", linewidth=2)
            continue
        ax.hlines(i, start, start + ttft, color="tab:orange", linewidth=2)
        ax.hlines(i, start + ttft, start + lat, color="tab:blue", linewidth=2)
    ax.plot([], [], color="tab:orange", label="waiting for first token")
    ax.plot([], [], color="tab:blue", label="decoding")
    if any(result["errors"]):
        ax.plot([], [], color="red", label="failed (send time)")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("request")
    ax.set_title(f"Request timeline ({n} requests)")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str | Path,
               goodput: Mapping[str, Any] | None = None) -> Path:
    """SLO attainment (left; `goodput`: a sweep's DistServe goodput, marked) and
    per-run goodput / throughput (right) against request rate."""
    plt = _pyplot()
    rows = [r for r in rows if math.isfinite(float(r["request_rate"]))]  # "inf" has no x
    rates = [float(r["request_rate"]) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    if rows and any(r.get("slo_attainment") is not None for r in rows):
        left.plot(rates, [100.0 * (r.get("slo_attainment") or 0.0) for r in rows], "o-",
                  label="all SLOs")
        for name in rows[0].get("slo_attainment_by_metric") or {}:
            left.plot(rates, [100.0 * r["slo_attainment_by_metric"][name] for r in rows],
                      ".--", label=name)
        if goodput is not None:
            _mark_goodput(left, goodput)
        left.legend(fontsize="small")
    else:
        left.text(0.5, 0.5, "no --goodput SLOs given", ha="center", transform=left.transAxes)
    left.set_title("SLO attainment")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("% of requests")
    left.set_ylim(0, 101)
    right.plot(rates, [r["request_throughput"] for r in rows], "o-", label="throughput")
    if any(r.get("request_goodput") is not None for r in rows):
        right.plot(rates, [r.get("request_goodput") or 0.0 for r in rows], "s-", label="goodput")
    right.plot(rates, rates, ":", color="gray", label="offered")
    right.set_title("Goodput and throughput")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("req/s")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, plt, path)


def _mark_goodput(ax: Any, goodput: Mapping[str, Any]) -> None:
    """The attainment target as a line; the DistServe goodput as a vertical line."""
    ax.axhline(100.0 * goodput["target"], color="gray", linestyle=":",
               label=f"target {100.0 * goodput['target']:g}%")
    if goodput["rate"] is not None:
        word = "≥ " if goodput["bound"] == "at_least" else ""
        ax.axvline(goodput["rate"], color="tab:red", linestyle="--",
                   label=f"DistServe goodput {word}{goodput['rate']:.3g} req/s")


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
