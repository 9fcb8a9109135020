"""``pdserve top``: a live terminal view of a running cluster, read from the
``/metrics`` endpoints of the router and every worker.

This module owns target discovery for the view, the window arithmetic (rates and
histogram percentiles from the difference between the newest scrape and the oldest
one kept, at most ``--window`` seconds old) and the frame layout. Targets come from
the Prometheus file-SD file that ``pdserve serve`` writes (``--file-sd``), from the
router's own list (``/metrics/targets``, asked each frame: workers come and go) when
only ``--router`` (default ``127.0.0.1:8000``) is given, or from ``--router`` plus
``--worker`` URLs. The screen is redrawn in place (cursor home,
each line cleared to its end) so it does not flicker. ``--once`` scrapes twice,
``--interval`` apart, prints one frame (rates over that interval, percentiles since
the processes started) and exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdserve.observability.file_sd import FileSD

# name -> [(labels, value)] of one target's scrape
Samples = dict[str, list[tuple[dict[str, str], float]]]
STAGES = (
    ("router queue", "pdserve_request_queue_seconds"),
    ("prefill queue", "pdserve_prefill_queue_seconds"),
    ("prefill", "pdserve_prefill_seconds"),
    ("KV transfer", "pdserve_kv_transfer_seconds"),
    ("decode queue", "pdserve_decode_queue_seconds"),
    ("TTFT", "pdserve_time_to_first_token_seconds"),
    ("TPOT", "pdserve_time_per_output_token_seconds"),
    ("ITL", "pdserve_inter_token_latency_seconds"),
    ("end-to-end", "pdserve_e2e_request_latency_seconds"),
)


@dataclass(frozen=True)
class Source:
    url: str  # the /metrics URL
    role: str  # router | prefill | decode | "" (unknown until scraped)
    name: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file-sd", help="Prometheus file-SD targets file written by `pdserve serve`")
    p.add_argument("--router", help="router base or /metrics URL (default "
                   "http://127.0.0.1:8000 when no --file-sd)")
    p.add_argument("--worker", action="append", default=[], help="worker /metrics URL (repeatable)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--window", type=float, default=60.0, help="seconds the rates cover")
    p.add_argument("--timeout", type=float, default=2.0, help="per-scrape timeout, seconds")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


def _metrics_url(url: str) -> str:
    url = url if "://" in url else f"http://{url}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def _asks_router(args: argparse.Namespace) -> bool:
    """Whether the workers come from the router's ``/metrics/targets``."""
    return not args.file_sd and not args.worker


def discover(args: argparse.Namespace) -> list[Source]:
    out = []
    if args.file_sd:
        out += [Source(_metrics_url(t.address), t.role, t.worker) for t in FileSD(args.file_sd).read()]
    router = args.router or (None if args.file_sd else "127.0.0.1:8000")
    if router is not None:
        listed = _listed(router, args.timeout) if _asks_router(args) else []
        out += listed or [Source(_metrics_url(router), "router", "router")]
    out += [Source(_metrics_url(u), "", urllib.parse.urlsplit(_metrics_url(u)).netloc)
            for u in args.worker]
    return out


def _listed(router: str, timeout: float) -> list[Source]:
    """The router's HTTP service discovery answer (none: an older or unreachable one)."""
    url = _metrics_url(router) + "/targets"
    try:
        groups = json.loads(urllib.request.urlopen(url, timeout=timeout).read())
        return [Source(_metrics_url(g["targets"][0]), g["labels"]["role"], g["labels"]["worker"])
                for g in groups]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return []


def scrape(src: Source, timeout: float) -> Samples | None:
    try:
        with urllib.request.urlopen(src.url, timeout=timeout) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return None
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: Samples | None, name: str, **match: str) -> float:
    return sum(v for labels, v in (samples or {}).get(name, [])
               if all(labels.get(k) == want for k, want in match.items()))


def buckets(samples: Samples | None, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, v in (samples or {}).get(name + "_bucket", []):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + v
    return out


def quantile(q: float, cum: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``{le: count}``."""
    les = sorted(cum)
    if not les or cum[les[-1]] <= 0:
        return None
    rank, lower, below = q * cum[les[-1]], 0.0, 0.0
    for le in les:
        if cum[le] >= rank:
            if le == float("inf"):
                return lower  # the highest finite bound
            return lower + (le - lower) * (rank - below) / max(cum[le] - below, 1e-12)
        lower, below = le, cum[le]
    return lower


class View:
    """Scrapes kept for the window, and the frame they make."""

    def __init__(self, sources: list[Source], window_s: float, since_start: bool = False) -> None:
        self.sources = sources
        self.window_s = window_s
        self.since_start = since_start  # percentiles over the processes' whole life
        self.history: deque[tuple[float, dict[str, Samples | None]]] = deque()

    def add(self, now: float, scrapes: dict[str, Samples | None]) -> None:
        self.history.append((now, scrapes))
        while len(self.history) > 2 and now - self.history[1][0] >= self.window_s:
            self.history.popleft()

    def delta(self, url: str, fn: str, **match: str) -> tuple[float, float] | None:
        """(increase of a counter, seconds) over the window, or None."""
        (t1, new), base = self.history[-1], self._base(url)
        if base is None or new.get(url) is None:
            return None
        t0, old = base
        return total(new[url], fn, **match) - total(old, fn, **match), t1 - t0

    def rate(self, url: str, fn: str, **match: str) -> float | None:
        d = self.delta(url, fn, **match)
        return d[0] / d[1] if d and d[1] > 0 else None

    def window_buckets(self, url: str, name: str) -> dict[float, float]:
        new = self.history[-1][1].get(url)
        base = None if self.since_start else self._base(url)
        cum = buckets(new, name)
        old = buckets(base[1], name) if base else {}
        return {le: n - old.get(le, 0.0) for le, n in cum.items()}

    def _base(self, url: str) -> tuple[float, Samples] | None:
        for t, scrapes in list(self.history)[:-1]:
            s = scrapes.get(url)
            if s is not None:
                return t, s
        return None

    def efficiency(self, urls: list[str]) -> tuple[float | None, float | None]:
        """(MFU, MBU) of these workers over the window's busy time."""
        flops = bytes_ = peak_f = peak_b = 0.0
        for url in urls:
            busy = self.delta(url, "pdserve_engine_step_seconds_sum")
            new = self.history[-1][1].get(url)
            f = self.delta(url, "pdserve_model_flops_total")
            b = self.delta(url, "pdserve_memory_bytes_read_total")
            if not (busy and f and b and new) or busy[0] <= 0:
                continue
            flops, bytes_ = flops + f[0], bytes_ + b[0]
            peak_f += busy[0] * total(new, "pdserve_device_peak_flops")
            peak_b += busy[0] * total(new, "pdserve_device_peak_bytes_per_second")
        if peak_f <= 0:
            if len(urls) == 1:  # idle in the window: the worker's own recent ratios
                new = self.history[-1][1].get(urls[0])
                return total(new, "pdserve_mfu_ratio"), total(new, "pdserve_mbu_ratio")
            return None, None
        return flops / peak_f, bytes_ / max(peak_b, 1e-12)

    def frame(self) -> list[str]:
        scrapes = self.history[-1][1]
        routers = [s for s in self.sources if s.role == "router"]
        workers = [s for s in self.sources if s.role != "router"]
        lines = [f"pdserve top  {time.strftime('%H:%M:%S')}  {len(self.sources)} targets  "
                 f"rates over {self._span():.3g}s"]
        for r in routers:
            if scrapes.get(r.url) is None:
                lines.append(f"router {r.url}: DOWN")
                continue
            req = self.rate(r.url, "pdserve_requests_total")
            gen = self.rate(r.url, "pdserve_generation_tokens_total")
            prompt = self.rate(r.url, "pdserve_prompt_tokens_total")
            lines.append(f"router {r.url}: {_num(req)} req/s  prompt {_num(prompt)} tok/s  "
                         f"generation {_num(gen)} tok/s")
        lines += ["", f"{'POOL':<10}{'WORKERS':>8}{'RUN':>6}{'WAIT':>6}{'KV USE':>8}"
                      f"{'TOK/S':>10}{'MFU':>8}{'MBU':>8}"]
        for role in ("prefill", "decode"):
            urls = [w.url for w in workers if _role(w, scrapes) == role]
            up = [u for u in urls if scrapes.get(u) is not None]
            if not urls:
                continue
            kv = [total(scrapes[u], "pdserve_kv_cache_usage_ratio") for u in up]
            tok = sum(self.rate(u, "pdserve_engine_tokens_total") or 0.0 for u in up)
            mfu, mbu = self.efficiency(up)
            lines.append(
                f"{role:<10}{f'{len(up)}/{len(urls)}':>8}"
                f"{sum(total(scrapes[u], 'pdserve_num_requests_running') for u in up):>6.0f}"
                f"{sum(total(scrapes[u], 'pdserve_num_requests_waiting') for u in up):>6.0f}"
                f"{_pct(sum(kv) / len(kv) if kv else None):>8}{_num(tok):>10}"
                f"{_pct(mfu):>8}{_pct(mbu):>8}")
        width = max([14, *(len(w.name) + 1 for w in workers)])  # names never run into roles
        lines += ["", f"{'WORKER':<{width}}{'ROLE':<9}{'RUN':>5}{'WAIT':>5}{'KV USE':>8}"
                      f"{'TOK/S':>9}{'STEP p50':>10}{'STEP p90':>10}{'MFU':>8}{'MBU':>8}"
                      f"{'KV MB/s':>9}"]
        for w in workers:
            s = scrapes.get(w.url)
            if s is None:
                lines.append(f"{w.name:<{width}}{w.role:<9}DOWN ({w.url})")
                continue
            step = self.window_buckets(w.url, "pdserve_engine_step_seconds")
            mfu, mbu = self.efficiency([w.url])
            kv_bps = self.rate(w.url, "pdserve_kv_transfer_bytes_total")
            lines.append(
                f"{w.name:<{width}}{_role(w, scrapes):<9}"
                f"{total(s, 'pdserve_num_requests_running'):>5.0f}"
                f"{total(s, 'pdserve_num_requests_waiting'):>5.0f}"
                f"{_pct(total(s, 'pdserve_kv_cache_usage_ratio')):>8}"
                f"{_num(self.rate(w.url, 'pdserve_engine_tokens_total')):>9}"
                f"{_dur(quantile(0.5, step)):>10}{_dur(quantile(0.9, step)):>10}"
                f"{_pct(mfu):>8}{_pct(mbu):>8}"
                f"{_num(kv_bps / 1e6 if kv_bps is not None else None):>9}")
        span = "since start" if self.since_start else f"last {self._span():.3g}s"
        lines += ["", f"{'STAGE (' + span + ')':<24}{'COUNT':>7}{'p50':>10}{'p90':>10}{'p99':>10}"]
        for label, hist in STAGES:
            cum: dict[float, float] = {}
            for r in routers:
                for le, n in self.window_buckets(r.url, hist).items():
                    cum[le] = cum.get(le, 0.0) + n
            count = cum.get(float("inf"), 0.0)
            lines.append(f"{label:<24}{count:>7.0f}" + "".join(
                f"{_dur(quantile(q, cum)):>10}" for q in (0.5, 0.9, 0.99)))
        return lines

    def _span(self) -> float:
        return self.history[-1][0] - self.history[0][0] if len(self.history) > 1 else 0.0


def _role(src: Source, scrapes: dict[str, Samples | None]) -> str:
    if src.role:
        return src.role
    for labels, _ in (scrapes.get(src.url) or {}).get("pdserve_num_requests_running", []):
        return labels.get("role", "?")
    return "?"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x < 1e4 else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _dur(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.2f}ms" if x < 0.01 else f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s"


def _scrape_all(view: View, timeout: float) -> None:
    view.add(time.monotonic(), {s.url: scrape(s, timeout) for s in view.sources})


def run(args: argparse.Namespace) -> int:
    view = View(discover(args), args.window, since_start=args.once)
    if args.once:
        _scrape_all(view, args.timeout)
        time.sleep(args.interval)
        _scrape_all(view, args.timeout)
        print("\n".join(view.frame()))
        return 0 if any(v is not None for v in view.history[-1][1].values()) else 1
    out = sys.stdout
    # SIGTERM ends the loop as Ctrl-C does, through the finally that shows the cursor
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    out.write("\x1b[?25l\x1b[2J")  # hide the cursor, clear once
    try:
        while True:
            if args.file_sd or _asks_router(args):  # workers come and go
                view.sources = discover(args)
            _scrape_all(view, args.timeout)
            out.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in view.frame()) + "\x1b[J")
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        out.write("\x1b[?25h")
        out.flush()
